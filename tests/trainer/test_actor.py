"""The actor's step on a small torch language model (the Megatron model is tested in test_models.py): gradients do
not depend on how a step is cut into micro-batches, and a few GRPO steps on a fixed batch raise the log-probs of the
rewarded responses and lower the loss."""

import copy

import numpy as np
import pytest
import torch

from services.trainer.actor import Actor, Groups
from services.trainer.batching import split_steps
from services.trainer.config import TrainerConfig
from services.trainer.data import from_groups
from services.trainer.optimizer import build_optimizer, build_scheduler
from tests.trainer.test_data import _group


class TinyLM(torch.nn.Module):
    """A test fixture with GPTModel's call signature: logits `[B, L, V]` from token ids."""

    def __init__(self, vocab: int = 16, hidden: int = 8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids, position_ids, attention_mask=None):
        h = self.embed(input_ids)
        h = torch.cumsum(h, dim=1) / (position_ids[..., None] + 1)  # a causal mix of the prefix
        return self.head(torch.tanh(self.mix(h)))


def _batch():
    groups = [
        _group("g0", [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]], [1.0, 0.0, 0.0, 1.0]),
        _group("g1", [[3, 3], [11, 12, 13], [2], [5, 5, 5]], [0.0, 1.0, 1.0, 0.0]),
    ]
    return from_groups(groups, 4)


def _actor(**settings) -> Actor:
    config = TrainerConfig(**{"rollout_batch_size": 2, "n_samples_per_prompt": 4, "global_batch_size": 8, "lr": 1e-2,
                              "clip_grad": 0.0, **settings})  # fmt: skip
    model = TinyLM()
    optimizer = build_optimizer(model, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.98), eps=1e-8)
    scheduler = build_scheduler(optimizer, 0, None, "constant", config.lr, 0.0)
    return Actor(config, model, optimizer, scheduler, Groups())


@pytest.mark.parametrize("loss", [{}, {"use_opsm": True, "opsm_delta": -1.0}], ids=["grpo", "opsm"])
@pytest.mark.parametrize("aggregation", [True, False])
def test_gradients_do_not_depend_on_micro_batching(aggregation, loss):
    """Also with OPSM, whose mask is each sample's own (at a delta of -1 it drops every negative-advantage token)."""
    grads = []
    for settings in (
        {"micro_batch_size": 1},
        {"micro_batch_size": 4},
        {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 12},
    ):
        actor = _actor(calculate_per_token_loss=aggregation, **settings, **loss)
        actor.train_rollout(_batch())
        grads.append([p.grad.clone() for p in actor.model.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    if loss:  # the masked tokens are missing from the gradient
        plain = _actor(calculate_per_token_loss=aggregation, micro_batch_size=1)
        plain.train_rollout(_batch())
        assert any(not torch.allclose(a, p.grad) for a, p in zip(grads[0], plain.model.parameters(), strict=True))


@pytest.mark.parametrize("aggregation", [True, False])
def test_a_step_whose_samples_all_failed_trains_on_nothing(aggregation):
    """Every reward failed (a hung reward worker): the step's loss is 0 and no weight moves, no division by zero."""
    actor = _actor(calculate_per_token_loss=aggregation, micro_batch_size=2)
    batch = _batch()
    batch.loss_masks = [mask * 0 for mask in batch.loss_masks]  # what failed samples give (test_data.py)
    before = [p.detach().clone() for p in actor.model.parameters()]
    metrics = actor.train_rollout(batch)[0]
    assert metrics["loss"] == 0.0
    for a, b in zip(before, actor.model.parameters(), strict=True):
        torch.testing.assert_close(a, b.detach())


def test_grpo_steps_raise_the_rewarded_responses_and_lower_the_loss():
    actor = _actor(micro_batch_size=2, use_rollout_logprobs=True, eps_clip=10.0)
    batch = _batch()
    before = actor.full_logprobs(copy.deepcopy(actor.model), batch)
    batch.rollout_logprobs = [before[i, : len(m)].numpy() for i, m in enumerate(batch.loss_masks)]  # a fixed old policy
    losses = [actor.train_rollout(batch)[0]["loss"] for _ in range(5)]
    after = actor.full_logprobs(actor.model, batch)
    mask = torch.tensor([len(r) for r in batch.loss_masks])
    change = [(after[i, : mask[i]] - before[i, : mask[i]]).sum().item() for i in range(len(batch))]
    rewarded = [i for i, r in enumerate(batch.rewards_B.tolist()) if r == 1.0]
    assert all(change[i] > 0 for i in rewarded)
    assert all(change[i] < 0 for i in range(len(batch)) if i not in rewarded)
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0]


@pytest.mark.parametrize("use_rollout_logprobs", [False, True], ids=["old-policy-forward", "first-step-forward"])
def test_a_rollouts_first_step_reports_how_far_the_engines_log_probs_are_from_the_trainers(use_rollout_logprobs):
    """The train-rollout agreement (slime's train_rollout_logprob_abs_diff): mean and max |trainer - engine| log-prob
    over the trained tokens that have the engine's, from the old policy's forward, or with --use-rollout-logprobs
    from the first step's, before it changes the weights."""
    actor = _actor(
        use_rollout_logprobs=use_rollout_logprobs, num_steps_per_rollout=2, global_batch_size=4, micro_batch_size=2
    )
    batch = _batch()
    trainer = actor.full_logprobs(actor.model, batch)
    lengths = batch.response_lengths()
    batch.rollout_logprobs = [trainer[i, :n].numpy() + (0.25 if i == 0 else 0.0) for i, n in enumerate(lengths)]
    batch.rollout_logprobs[1] = np.zeros(0, np.float32)  # a sample without the engine's: left out
    steps = actor.train_rollout(batch)
    first = split_steps(list(range(len(batch))), 2)[0] if use_rollout_logprobs else range(len(batch))
    counted = sum(lengths[i] for i in first if i != 1)  # --use-rollout-logprobs: the first step's samples
    assert steps[-1]["train_rollout_logprob_abs_diff"] == pytest.approx(0.25 * lengths[0] / counted, abs=1e-5)
    assert steps[-1]["train_rollout_logprob_abs_diff_max"] == pytest.approx(0.25, abs=1e-5)


def test_a_few_steps_on_the_megatron_model_lower_the_loss(tmp_path):
    """The same on the real model: a Qwen3 checkpoint as a Megatron GPTModel (TP=1, this process), a fixed batch and
    a fixed old policy; with recompute on, as --recompute-activations runs it."""
    from services.train.tiny_checkpoint import write_tiny_model
    from services.trainer.models import load_gpt_model
    from services.trainer.parallel import init_parallel

    init_parallel(tp_size=1)
    settings = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    model, gpt = load_gpt_model(write_tiny_model(tmp_path / "m"), **settings)
    config = TrainerConfig(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8, lr=1e-3,
                           micro_batch_size=4,
                           use_rollout_logprobs=True, eps_clip=10.0)  # fmt: skip
    optimizer = build_optimizer(model, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.98), eps=1e-8)
    actor = Actor(config, model, optimizer, build_scheduler(optimizer, 0, None, "constant", config.lr, 0.0),
                  Groups(vocab_size=gpt.shape.vocab_size))  # fmt: skip
    batch = _batch()
    before = actor.full_logprobs(model, batch)
    batch.rollout_logprobs = [before[i, : len(m)].numpy() for i, m in enumerate(batch.loss_masks)]
    losses = [actor.train_rollout(batch)[0]["loss"] for _ in range(4)]
    assert losses[1] < losses[0] and max(losses[2:]) < losses[0] - 1.0, losses


@pytest.mark.parametrize("tied", [False, True], ids=["own-output-layer", "tied-embeddings"])
def test_log_probs_from_hidden_states_equal_the_logits_path_on_the_megatron_model(tmp_path, tied):
    """--log-probs-from-hidden: the response tokens' log-probs and entropies from the last hidden states and the
    output weight, streamed over the vocabulary, equal the output layer's logits path, and so does every parameter's
    gradient (float32, to 1e-5)."""
    from services.train.tiny_checkpoint import write_tiny_model
    from services.trainer.models import load_gpt_model
    from services.trainer.parallel import init_parallel

    init_parallel(tp_size=1)
    model, gpt = load_gpt_model(write_tiny_model(tmp_path / "m", tie_word_embeddings=tied))
    batch, results = _batch(), []
    for from_hidden in (False, True):
        config = TrainerConfig(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8,
                               log_probs_from_hidden=from_hidden)  # fmt: skip
        actor = Actor(config, model, None, None, Groups(vocab_size=gpt.shape.vocab_size))
        model.zero_grad()
        logprobs, entropies = actor.logprobs(model, batch, list(range(len(batch))), entropy=True)
        (logprobs.sum() + 0.5 * entropies.sum()).backward()
        grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
        results.append((logprobs.detach(), entropies.detach(), grads))
    (logprobs, entropies, grads), (hidden_logprobs, hidden_entropies, hidden_grads) = results
    torch.testing.assert_close(hidden_logprobs, logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden_entropies, entropies, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():  # sums over many tokens in another order: to 1e-5 of the largest entry
        torch.testing.assert_close(hidden_grads[name], grad, atol=1e-5 * float(grad.abs().max()), rtol=1e-5)


class _Recorder(torch.optim.SGD):
    """An optimizer that moves nothing (lr 0) and keeps each step's gradients."""

    def __init__(self, model):
        super().__init__(model.parameters(), lr=0.0)
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.seen: list[dict[str, torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append({self.names[id(p)]: p.grad.clone() for g in self.param_groups for p in g["params"]
                          if p.grad is not None})  # fmt: skip


@pytest.mark.parametrize(
    "loss",
    [{}, {"advantage_estimator": "gspo"}, {"advantage_estimator": "cispo"},
     {"advantage_estimator": "reinforce_plus_plus"}, {"advantage_estimator": "ppo"}, {"entropy_coef": 0.05},
     {"use_opd": True, "opd_type": "sglang"}],
    ids=["grpo", "gspo", "cispo", "reinforce++", "ppo-with-critic", "entropy-bonus", "opd"],
)  # fmt: skip
def test_every_loss_gets_the_same_gradients_from_hidden_states_as_from_logits(tmp_path, loss):
    """--log-probs-from-hidden for each loss the trainer has: a rollout's training step (old log-probs, advantages,
    the loss over two micro-batches) leaves every parameter the same gradient as the output layer's logits path
    (float32, to 1e-5 of the largest entry)."""
    from services.train.tiny_checkpoint import write_tiny_model
    from services.trainer.critic import Critic, load_critic
    from services.trainer.models import load_gpt_model
    from services.trainer.parallel import init_parallel

    init_parallel(tp_size=1)
    path = write_tiny_model(tmp_path / "m")
    batch = _batch()
    batch.teacher_logprobs = [np.full(len(m), -1.5, np.float32) for m in batch.loss_masks]
    ppo = {"num_critic_only_steps": 0, "gamma": 1.0, "lambd": 0.95} if loss.get("advantage_estimator") == "ppo" else {}
    seen = []
    for from_hidden in (False, True):
        config = TrainerConfig(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8, micro_batch_size=4,
                               clip_grad=0.0, log_probs_from_hidden=from_hidden, **loss, **ppo)  # fmt: skip
        model, gpt = load_gpt_model(path)
        recorder = _Recorder(model)
        actor = Actor(config, model, recorder, build_scheduler(recorder, 0, None, "constant", 0.0, 0.0),
                      Groups(vocab_size=gpt.shape.vocab_size))  # fmt: skip
        if ppo:
            critic, _ = load_critic(path, torch.float32)
            optimizer = build_optimizer(critic, lr=0.0, weight_decay=0.0, betas=(0.9, 0.98), eps=1e-8)
            actor.critic = Critic(config, critic, optimizer, build_scheduler(optimizer, 0, None, "constant", 0.0, 0.0),
                                  Groups(vocab_size=gpt.shape.vocab_size))  # fmt: skip
        actor.train_rollout(batch)
        seen.append(recorder.seen[-1])
    logits, hidden = seen
    assert logits.keys() == hidden.keys() and logits
    for name, grad in logits.items():
        assert grad.abs().max() > 0 or name.endswith("bias"), name
        torch.testing.assert_close(hidden[name], grad, atol=1e-5 * float(grad.abs().max()), rtol=1e-5)


def test_ppo_trains_the_critic_first_then_the_policy(tmp_path):
    """PPO on the Megatron model: GAE from the critic's values; during --num-critic-only-steps only the critic moves,
    and its value loss falls."""
    from services.train.tiny_checkpoint import write_tiny_model
    from services.trainer.critic import Critic, load_critic
    from services.trainer.models import load_gpt_model
    from services.trainer.parallel import init_parallel

    init_parallel(tp_size=1)
    path = write_tiny_model(tmp_path / "m")
    config = TrainerConfig(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8, lr=1e-3,
                           advantage_estimator="ppo", num_critic_only_steps=2, micro_batch_size=4, gamma=1.0,
                           lambd=0.95)  # fmt: skip
    parts = []
    for load in (load_gpt_model, lambda p: load_critic(p, torch.float32)):
        model, gpt = load(path)
        optimizer = build_optimizer(model, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.98), eps=1e-8)
        parts.append((model, optimizer, build_scheduler(optimizer, 0, None, "constant", config.lr, 0.0)))
    groups = Groups(vocab_size=gpt.shape.vocab_size)
    actor, critic = Actor(config, *parts[0], groups), Critic(config, *parts[1], groups)
    actor.critic = critic
    batch = _batch()
    policy = [p.detach().clone() for p in actor.model.parameters()]
    steps = [actor.train_rollout(batch, rollout=r)[0] for r in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(policy, actor.model.parameters(), strict=True))
    steps += [actor.train_rollout(batch, rollout=r)[0] for r in range(2, 4)]
    value_losses = [s["critic/value_loss"] for s in steps]
    assert value_losses[-1] < value_losses[0]
    assert "loss" not in steps[0] and "loss" not in steps[1] and "loss" in steps[2]  # critic-only, then both
    moved = [not torch.equal(a, b) for a, b in zip(policy, actor.model.parameters(), strict=True)]
    assert any(moved)


def _routing_of_each_forward(actor: Actor, batch) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Trains one rollout; returns each forward's samples and its routers' choices (routing maps), in call order."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    calls = []

    def logprobs(model, batch, indices, entropy=False):
        calls.append((indices, []))
        return forward(model, batch, indices, entropy)

    forward, actor.logprobs = actor.logprobs, logprobs
    for layer in actor.model.decoder.layers:
        layer.mlp.router.register_forward_hook(lambda module, args, output: calls[-1][1].append(output[1].clone()))
    try:
        actor.train_rollout(batch)
    finally:
        RouterReplay.clear_global_router_replay_instances()  # the next model's routers register anew
    return calls


@pytest.mark.parametrize("replay", [True, False])
def test_routing_replay_trains_through_the_experts_the_old_policy_chose(tmp_path, replay):
    """Qwen3-MoE, two optimizer steps on one rollout with a large learning rate: with --use-routing-replay every
    training forward (the second step's too, after the first moved the routers) sends each token to the experts the
    old policy chose; without it the second step's routing has moved."""
    from services.train.tiny_checkpoint import write_tiny_model
    from services.trainer.models import load_gpt_model
    from services.trainer.parallel import init_parallel

    init_parallel(tp_size=1)
    settings = {"moe_enable_routing_replay": True} if replay else {}
    model, gpt = load_gpt_model(write_tiny_model(tmp_path / "m", arch="qwen3_moe"), **settings)
    config = TrainerConfig(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=4, num_steps_per_rollout=2,
                           lr=0.05, micro_batch_size=2, clip_grad=0.0, use_routing_replay=replay)  # fmt: skip
    optimizer = build_optimizer(model, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.98), eps=1e-8)
    actor = Actor(config, model, optimizer, build_scheduler(optimizer, 0, None, "constant", config.lr, 0.0),
                  Groups(vocab_size=gpt.shape.vocab_size))  # fmt: skip
    calls = _routing_of_each_forward(actor, _batch())

    def by_token(forwards) -> dict:
        """(sample, position, layer) -> the experts chosen (routers see a micro-batch's tokens position-major)."""
        chosen = {}
        for indices, maps in forwards:
            for layer, routing_map in enumerate(maps):
                for b, sample in enumerate(indices):
                    for position in range(len(_batch().tokens[sample])):
                        chosen[sample, position, layer] = routing_map[position * len(indices) + b]
        return chosen

    old, first, second = (by_token(forwards) for forwards in (calls[:4], calls[4:6], calls[6:]))
    assert all(torch.equal(routing, old[token]) for token, routing in first.items())  # nothing has moved yet
    same = [torch.equal(routing, old[token]) for token, routing in second.items()]
    assert all(same) if replay else not all(same)


def test_rollout_routing_replay_routes_every_forward_as_the_engine_did(tmp_path):
    """--use-rollout-routing-replay: the samples carry the engine's routing (SGLang's routed_experts: int32 [tokens - 1,
    layers, top-k]); the old policy's forward and the training's route every token as given, whatever the routers
    would choose."""
    import numpy as np

    from services.train.tiny_checkpoint import write_tiny_model
    from services.trainer.models import load_gpt_model
    from services.trainer.parallel import init_parallel

    init_parallel(tp_size=1)
    model, gpt = load_gpt_model(write_tiny_model(tmp_path / "m", arch="qwen3_moe"), moe_enable_routing_replay=True)
    config = TrainerConfig(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8, lr=1e-3,
                           micro_batch_size=2, use_rollout_routing_replay=True)  # fmt: skip
    optimizer = build_optimizer(model, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.98), eps=1e-8)
    actor = Actor(config, model, optimizer, build_scheduler(optimizer, 0, None, "constant", config.lr, 0.0),
                  Groups(vocab_size=gpt.shape.vocab_size))  # fmt: skip
    batch, generator = _batch(), torch.Generator().manual_seed(0)
    engine = [torch.stack([torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(2)])
                           for _ in range(len(tokens) - 1)]).int() for tokens in batch.tokens]  # fmt: skip
    batch.routed_experts = [np.ascontiguousarray(chosen.numpy()).tobytes() for chosen in engine]
    calls = _routing_of_each_forward(actor, batch)
    assert len(calls) == 8  # the old policy's 4 micro-batches, then the step's 4
    for indices, maps in calls:
        for layer, routing_map in enumerate(maps):
            for b, sample in enumerate(indices):
                for position, experts in enumerate(engine[sample][:, layer]):
                    chosen = routing_map[position * len(indices) + b].nonzero().flatten()
                    assert sorted(chosen.tolist()) == sorted(experts.tolist())


def test_slimes_global_batch_size_gives_two_optimizer_steps_a_rollout_each_the_step_on_its_half():
    """slime's arithmetic: --global-batch-size 128 with 32 prompts x 8 samples is two optimizer steps a rollout
    (--num-steps-per-rollout worked out), and the rollout trains as the step called on its first half, then on its
    second, with the old policy's log-probs and the advantages of the whole rollout."""
    import random

    from services.common.config import load_config

    flags = ["--global-batch-size", "128", "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
             "--lr", "1e-2", "--clip-grad", "0", "--micro-batch-size", "16"]  # fmt: skip
    config = load_config(TrainerConfig, flags, "slipstream trainer")
    assert (config.global_batch_size, config.num_steps_per_rollout) == (128, 2)
    rng = random.Random(0)
    groups = [_group(f"g{i}", [[rng.randrange(1, 14) for _ in range(rng.randrange(1, 5))] for _ in range(8)],
                     [float(rng.random() < 0.5) for _ in range(8)]) for i in range(32)]  # fmt: skip
    batch = from_groups(groups, 8)
    actors = []
    for _ in range(2):
        model = TinyLM()
        optimizer = build_optimizer(model, lr=config.lr, weight_decay=0.0, betas=(0.9, 0.98), eps=1e-8)
        scheduler = build_scheduler(optimizer, 0, None, "constant", config.lr, 0.0)
        actors.append(Actor(config, model, optimizer, scheduler, Groups()))
    rollout, halves = actors
    halves.model.load_state_dict(rollout.model.state_dict())
    calls, step = [], rollout._step

    def recorded(batch, indices, per_step):
        calls.append((list(indices), per_step))
        return step(batch, indices, per_step)

    rollout._step = recorded
    trained = rollout.train_rollout(batch)
    assert [indices for indices, _ in calls] == [list(range(128)), list(range(128, 256))]
    halves.model.train()
    by_half = [halves._step(batch, indices, per_step) for indices, per_step in calls]
    assert len(trained) == 2
    for whole, half in zip(trained, by_half, strict=True):
        assert whole["pg_loss"] == pytest.approx(half["pg_loss"], abs=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(rollout.model.parameters(), halves.model.parameters(), strict=True))


def test_a_sample_longer_than_a_chosen_token_budget_trains_alone():
    """A --max-tokens-per-gpu the user gave refuses a longer sample; one the trainer chose from the free memory
    (services/trainer/token_budget.py) lets it train alone in its micro-batch."""
    from services.trainer.batching import BatchSizeError

    actor, batch = _actor(use_dynamic_batch_size=True, max_tokens_per_gpu=4), _batch()
    with pytest.raises(BatchSizeError, match="does not fit --max-tokens-per-gpu 4"):
        actor._micro_batches(batch, list(range(len(batch))))
    actor.budget_chosen = True
    micro_batches = actor._micro_batches(batch, list(range(len(batch))))
    assert sorted(i for mb in micro_batches for i in mb) == list(range(len(batch)))
    assert all(len(mb) == 1 for mb in micro_batches if max(batch.lengths()[i] for i in mb) > 4)
