"""slime's training extension points on the actor (services/trainer/hooks.py): a user function that computes what the
built-in code computes trains exactly as the built-in code does, whatever the micro-batches, so the shapes, the
packing of the logits and the scaling the functions see are slime's; and a function that returns the wrong thing is
named with what was expected."""

import statistics

import pytest
import torch

from services.common.config import ConfigError, load_config
from services.trainer.config import TrainerConfig
from tests.trainer.test_actor import _actor, _batch
from tests.trainer.test_data import _group

HERE = "tests.trainer.test_hooks"
EXAMPLES = "examples/slime_plugins"


def _groups():
    return [
        _group("g0", [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]], [1.0, 0.0, 0.0, 1.0]),
        _group("g1", [[3, 3], [11, 12, 13], [2], [5, 5, 5]], [0.0, 1.0, 1.0, 0.0]),
    ]


def _gradients(actor, batch=None) -> list[torch.Tensor]:
    metrics = actor.train_rollout(batch if batch is not None else actor.hooks.batch(_groups(), 4))[0]
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values()), metrics
    return [p.grad.clone() for p in actor.model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


# Functions as users write them for slime


def ppo_loss(args, batch, logits, sum_of_sample_mean):
    """PPO's clipped surrogate from the logits, as slime's policy loss computes it."""
    log_probs, offset = [], 0
    for tokens, total, response in zip(
        batch["unconcat_tokens"], batch["total_lengths"], batch["response_lengths"], strict=True
    ):
        rows = logits[0, offset + total - response - 1 : offset + total - 1]
        log_probs.append(torch.log_softmax(rows.float(), -1).gather(-1, tokens[total - response :, None])[:, 0])
        offset += total
    ratio = torch.exp(torch.cat(log_probs) - torch.cat(batch["log_probs"]))
    advantages = torch.cat(batch["advantages"])
    clipped = ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip)
    pg_loss = sum_of_sample_mean(torch.maximum(-ratio * advantages, -clipped * advantages))
    return pg_loss, {"loss": pg_loss.detach(), "pg_loss": pg_loss.detach()}


def vanilla_tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """slime's own default TIS function."""
    tis = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weights = torch.clamp(tis, min=args.tis_clip_low, max=args.tis_clip)
    return pg_loss * weights, loss_masks, {"tis": tis.detach(), "tis_clipfrac": (weights != tis).float()}


def grpo_rewards(args, samples):
    """slime's default reward post-processing for GRPO."""
    raw = [s.reward for s in samples]
    n = args.n_samples_per_prompt
    out = []
    for start in range(0, len(raw), n):
        group = raw[start : start + n]
        out += [(r - statistics.fmean(group)) / (statistics.stdev(group) + 1e-6) for r in group]
    return raw, out


def default_conversion(args, samples):
    raw, rewards = grpo_rewards(args, samples)
    return {"tokens": [s.tokens for s in samples], "response_lengths": [s.response_length for s in samples],
            "loss_masks": [s.loss_mask for s in samples], "rewards": rewards, "raw_reward": raw,
            "rollout_log_probs": [s.rollout_log_probs for s in samples]}  # fmt: skip


def no_advantages(args, rollout_data):
    rollout_data["returns"] = rollout_data["rewards"]


def too_few_samples(args, samples):
    return {**default_conversion(args, samples), "tokens": [samples[0].tokens]}


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("micro_batch_size", [1, 2, 8])
def test_a_custom_loss_computing_ppo_from_the_logits_trains_as_the_built_in_loss(per_token, micro_batch_size):
    settings = {"calculate_per_token_loss": per_token, "micro_batch_size": micro_batch_size, "eps_clip": 0.1}
    custom = _actor(**settings, loss_type="custom_loss", custom_loss_function_path=f"{HERE}:ppo_loss")
    _same(_gradients(_actor(**settings)), _gradients(custom))


def test_the_example_loss_runs_and_its_metrics_reach_the_step():
    actor = _actor(micro_batch_size=2, loss_type="custom_loss",
                   custom_loss_function_path=f"{EXAMPLES}/loss.py:reinforce_loss")  # fmt: skip
    metrics = actor.train_rollout(actor.hooks.batch(_groups(), 4))[0]
    assert {"loss", "pg_loss", "log_prob"} <= set(metrics) and metrics["log_prob"] < 0


@pytest.mark.parametrize("per_token", [True, False])
def test_slimes_vanilla_tis_as_a_custom_tis_trains_as_use_tis(per_token):
    settings = {"calculate_per_token_loss": per_token, "micro_batch_size": 2, "use_tis": True, "tis_clip": 1.05,
                "tis_clip_low": 0.8}  # fmt: skip
    built_in, custom = _actor(**settings), _actor(**settings, custom_tis_function_path=f"{HERE}:vanilla_tis")
    _same(_gradients(built_in, _off_policy(built_in)), _gradients(custom, _off_policy(custom)))
    metrics = custom.train_rollout(_off_policy(custom))[0]
    assert 0.2 < metrics["tis_clipfrac"] < 0.8


def _off_policy(actor):
    """The batch with engine log-probs 0.1 above or below the trainer's, token by token: TIS ratios of 0.9 and 1.1
    (half of them clipped)."""
    batch = actor.hooks.batch(_groups(), 4)
    old = actor.full_logprobs(actor.model, batch)
    batch.rollout_logprobs = [(old[i, : len(m)] + 0.1 * (-1) ** torch.arange(len(m))).numpy()
                              for i, m in enumerate(batch.loss_masks)]  # fmt: skip
    return batch


def test_the_example_icepop_tis_drops_the_tokens_outside_the_bounds():
    actor = _actor(micro_batch_size=2, use_tis=True, tis_clip=1e-9, tis_clip_low=0.0,
                   custom_tis_function_path=f"{EXAMPLES}/tis.py:icepop")  # fmt: skip
    metrics = actor.train_rollout(actor.hooks.batch(_groups(), 4))[0]  # every ratio is above 1e-9: all dropped
    assert metrics["tis_clipfrac"] == pytest.approx(1.0) and metrics["pg_loss"] == 0.0 and "tis_abs" in metrics


def test_the_example_advantages_train_as_grpo():
    custom = _actor(micro_batch_size=2, custom_advantage_function_path=f"{EXAMPLES}/advantages.py:grpo_advantages")
    _same(_gradients(_actor(micro_batch_size=2)), _gradients(custom))


def test_slimes_grpo_normalization_as_a_reward_post_processing_or_a_conversion_trains_as_the_built_in():
    expected = _gradients(_actor(micro_batch_size=2))
    post = _actor(micro_batch_size=2, custom_reward_post_process_path=f"{HERE}:grpo_rewards")
    _same(expected, _gradients(post))
    converted = _actor(micro_batch_size=2, custom_convert_samples_to_train_data_path=f"{HERE}:default_conversion")
    _same(expected, _gradients(converted))
    batch = converted.hooks.batch(_groups(), 4)
    assert batch.normalized and batch.scored_rewards_B.tolist() == _batch().rewards_B.tolist()


def test_the_example_rank_rewards_replace_the_normalization():
    actor = _actor(micro_batch_size=2, custom_reward_post_process_path=f"{EXAMPLES}/rewards.py:rank_rewards")
    batch = actor.hooks.batch(_groups(), 4)
    assert batch.rewards_B.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, -2 / 3, 2 / 3, 2 / 3, -2 / 3])
    assert batch.scored_rewards_B.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert all(torch.isfinite(torch.tensor(v)) for v in actor.train_rollout(batch)[0].values())


def test_the_example_conversion_trains_every_finished_sample():
    convert = f"{EXAMPLES}/convert.py:convert_samples_to_train_data"
    actor = _actor(micro_batch_size=2, custom_convert_samples_to_train_data_path=convert)
    batch = actor.hooks.batch(_groups(), 4)
    assert [m.sum() for m in batch.loss_masks] == [3, 2, 1, 4, 2, 3, 1, 3]
    actor.train_rollout(batch)


def test_a_function_that_returns_the_wrong_thing_is_named():
    actor = _actor(custom_advantage_function_path=f"{HERE}:no_advantages")
    with pytest.raises(ValueError, match=r"--custom-advantage-function-path must set rollout_data\['advantages'\]"):
        actor.train_rollout(actor.hooks.batch(_groups(), 4))
    actor = _actor(custom_convert_samples_to_train_data_path=f"{HERE}:too_few_samples")
    with pytest.raises(ValueError, match="returned 1 samples for 8"):
        actor.hooks.batch(_groups(), 4)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--loss-type", "custom_loss"], "--loss-type custom_loss and --custom-loss-function-path go together"),
        (["--custom-loss-function-path", "x.py:f"], "go together"),
        (["--custom-tis-function-path", "x.py:f"], "add --use-tis"),
        (
            [
                "--loss-type",
                "custom_loss",
                "--custom-loss-function-path",
                "x.py:f",
                "--pipeline-model-parallel-size",
                "2",
            ],
            "--pipeline-model-parallel-size 1",
        ),
    ],
)
def test_hook_settings_that_cannot_work_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainerConfig, flags, prog="slipstream trainer")
