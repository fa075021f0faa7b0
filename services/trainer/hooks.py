"""slime's training extension points, called with slime's signatures and argument shapes (docs/plugins.md):

- `--custom-convert-samples-to-train-data-path`: `fn(args, samples) -> dict` (tokens, response_lengths, loss_masks,
  rewards, raw_reward, optional rollout_log_probs) replaces how the step's samples become training data;
- `--custom-reward-post-process-path`: `fn(args, samples) -> (raw_rewards, rewards)` replaces the group
  normalization of the rewards;
- `--custom-advantage-function-path`: `fn(args, rollout_data)` fills `rollout_data["advantages"]` and
  `["returns"]`, one tensor per sample over its response;
- `--custom-tis-function-path`: `fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
  response_lengths) -> (pg_loss, loss_masks, metrics)` replaces the truncated importance sampling (with --use-tis);
- `--custom-loss-function-path` (with `--loss-type custom_loss`): `fn(args, batch, logits, sum_of_sample_mean) ->
  (loss, metrics)` replaces the actor's loss; `logits` is `[1, T, V]`, the micro-batch's sequences one after another;
- `--custom-rollout-log-function-path`: `fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time) -> bool`
  gets each step's samples on rank 0; True skips the step's TensorBoard scalars (steps.jsonl is always written).

Per-token values go to and come from these functions as slime has them: one 1-D tensor per sample over its response
tokens, or those tensors concatenated. Each data-parallel rank calls them on its own share of the step."""

import numpy as np
import torch

from services.common.plugins import load_callable
from services.common.slime_api import Sample, args_of, samples_of
from services.trainer.data import BatchError, RolloutBatch, from_groups
from services.trainer.losses import aggregate
from services.trainer.preflight import NAMES, flag
from slipstream.v1 import common_pb2


class Hooks:
    def __init__(self, config):
        self.args = args_of(config)
        self.functions = {
            name: load_callable(getattr(config, name), flag(name)) for name in NAMES if getattr(config, name)
        }

    def __getitem__(self, name: str):
        return self.functions.get(name)

    # Samples → training data

    def batch(self, groups: list[common_pb2.PromptGroup], group_size: int) -> RolloutBatch:
        """This rank's batch; its rewards marked as normalized when a hook has processed them."""
        batch = from_groups(groups, group_size)
        convert = self["custom_convert_samples_to_train_data_path"]
        post_process = self["custom_reward_post_process_path"]
        if convert is None and post_process is None:
            return batch
        samples = samples_of(groups)
        if convert is not None:
            return _from_train_data(convert(self.args, samples), batch, samples)
        raw, rewards = post_process(self.args, samples)
        batch.raw_rewards_B = _rewards(raw, len(samples), "custom_reward_post_process_path", "raw_rewards")
        batch.rewards_B = _rewards(rewards, len(samples), "custom_reward_post_process_path", "rewards")
        batch.normalized = True
        return batch

    def log_rollout(self, step: int, groups: list[common_pb2.PromptGroup], metrics: dict) -> bool:
        """Calls the rollout log function, if any; True when it asks to skip the default logging."""
        function = self["custom_rollout_log_function_path"]
        if function is None:
            return False
        return function(step, self.args, samples_of(groups), metrics, metrics.get("wait_s", 0.0)) is True

    # Advantages

    def advantages(self, batch: RolloutBatch, t: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, R]` advantages and returns from the custom advantage function; `t` holds the `[B, R]` tensors
        (old, ref, values, rollout log-probs, kl, mask) as the actor has them."""
        lengths = batch.response_lengths()
        data = _slime_rows(t, lengths, "log_probs", "ref_log_probs", "values", "rollout_log_probs", "kl", "loss_masks")
        data.update(rewards=t["rewards"].tolist(), response_lengths=lengths, total_lengths=batch.lengths())
        self["custom_advantage_function_path"](self.args, data)
        out = []
        for key in ("advantages", "returns"):
            rows = data.get(key)
            if rows is None or len(rows) != len(lengths):
                raise ValueError(
                    f"--custom-advantage-function-path must set rollout_data[{key!r}] to one tensor per "
                    f"sample ({len(lengths)}), got {type(rows).__name__}"
                )
            out.append(_padded(rows, lengths, t["mask"].shape[1], f"rollout_data[{key!r}]"))
        return out[0], out[1]

    # Inside the loss

    def tis_function(self, lengths: list[int], prompt_lengths: list[int]):
        """The custom TIS function over `[b, R]` tensors (what `losses.policy_loss` calls), for rows of these
        response lengths."""
        function = self["custom_tis_function_path"]
        if function is None:
            return None

        def tis(pg_loss_BT, old_BT, rollout_BT, mask_BT):
            width = mask_BT.shape[1]
            pg_loss, masks, metrics = function(
                self.args,
                pg_loss=_flat(pg_loss_BT, lengths),
                train_log_probs=_rows(old_BT, lengths),
                rollout_log_probs=_rows(rollout_BT, lengths),
                loss_masks=_rows(mask_BT, lengths),
                total_lengths=[p + n for p, n in zip(prompt_lengths, lengths, strict=True)],
                response_lengths=lengths,
            )
            return (
                _unflat(pg_loss, lengths, width, "the pg_loss it returns"),
                _padded(masks, lengths, width, "the loss_masks it returns"),
                {k: _unflat(v, lengths, width, f"metric {k!r}") for k, v in metrics.items()},
            )

        return tis

    def loss(self, logits_BLV: torch.Tensor, inputs: dict, take: dict, lengths: list[int], token_level: bool):
        """The custom loss of one micro-batch: slime's batch of per-sample lists, the sequences' logits packed into
        `[1, T, V]`, and `sum_of_sample_mean` (the mean over trained tokens, or per sample then over samples)."""
        totals = [end for _, end in inputs["spans"]]
        tokens = [inputs["tokens_BL"][b, :n] for b, n in enumerate(totals)]
        batch = _slime_rows(
            take, lengths, "advantages", "log_probs", "ref_log_probs", "rollout_log_probs", "loss_masks"
        )
        batch.update(
            tokens=tokens,
            unconcat_tokens=tokens,
            total_lengths=totals,
            response_lengths=lengths,
            rewards=take["rewards"].tolist(),
        )
        logits = torch.cat([logits_BLV[b, :n] for b, n in enumerate(totals)])[None]
        mask_BR = take["mask"]

        def sum_of_sample_mean(values: torch.Tensor) -> torch.Tensor:
            values_BR = _unflat(values, lengths, mask_BR.shape[1], "the tensor given to sum_of_sample_mean")
            return aggregate(values_BR, mask_BR, "token" if token_level else "sequence")

        loss, metrics = self["custom_loss_function_path"](self.args, batch, logits, sum_of_sample_mean)
        if not (torch.is_tensor(loss) and loss.dim() == 0 and isinstance(metrics, dict)):
            raise ValueError(
                "--custom-loss-function-path must return (loss, metrics): a scalar tensor and a dict, "
                f"got ({type(loss).__name__}, {type(metrics).__name__})"
            )
        return loss, {name: torch.as_tensor(value).detach() for name, value in metrics.items()}


# slime's names of the per-sample lists → the actor's names of the `[B, R]` tensors they come from
SLIME_ROWS = {"advantages": "adv", "log_probs": "old", "ref_log_probs": "ref", "values": "values",
              "rollout_log_probs": "rollout", "kl": "kl", "loss_masks": "mask"}  # fmt: skip


def _slime_rows(tensors: dict, lengths: list[int], *names: str) -> dict:
    """The lists slime's hooks take, by slime's names, from the actor's tensors (None where the actor has none)."""
    return {name: _rows(tensors.get(SLIME_ROWS[name]), lengths) for name in names}


def _rows(values_BR: torch.Tensor | None, lengths: list[int]) -> list[torch.Tensor] | None:
    return None if values_BR is None else [values_BR[b, :n] for b, n in enumerate(lengths)]


def _flat(values_BR: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    return torch.cat(_rows(values_BR, lengths))


def _unflat(values: torch.Tensor, lengths: list[int], width: int, what: str) -> torch.Tensor:
    """A 1-D tensor of the responses one after another, back to `[b, width]` (zero padded), keeping its graph."""
    if values.dim() != 1 or values.numel() != sum(lengths):
        raise ValueError(
            f"{what} has shape {tuple(values.shape)}; expected the {sum(lengths)} response tokens of the "
            "micro-batch one after another (1-D)"
        )
    return _padded(list(values.split(lengths)), lengths, width, what)


def _padded(rows, lengths: list[int], width: int, what: str) -> torch.Tensor:
    rows = [torch.as_tensor(row, dtype=torch.float32) if not torch.is_tensor(row) else row for row in rows]
    for b, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        if row.shape != (n,):
            raise ValueError(f"{what}: sample {b} has shape {tuple(row.shape)}, its response {n} tokens")
    return torch.stack([torch.nn.functional.pad(row, (0, width - len(row))) for row in rows])


def _rewards(values, count: int, name: str, what: str) -> torch.Tensor:
    rewards = torch.as_tensor([float(v) for v in values], dtype=torch.float32)
    if rewards.shape != (count,):
        raise ValueError(f"{flag(name)} returned {len(rewards)} {what} for {count} samples")
    return rewards


def _from_train_data(data: dict, batch: RolloutBatch, samples: list[Sample]) -> RolloutBatch:
    """The batch as the custom conversion's dict has it: its tokens, response lengths, loss masks and rewards (taken
    as normalized, as slime's conversion normalizes them), for the same samples in the same order."""
    name = "custom_convert_samples_to_train_data_path"
    missing = {"tokens", "response_lengths", "loss_masks", "rewards"} - set(data)
    if missing:
        raise ValueError(f"{flag(name)} returned no {', '.join(sorted(missing))}")
    if len(data["tokens"]) != len(samples):
        raise ValueError(
            f"{flag(name)} returned {len(data['tokens'])} samples for {len(samples)}: a step trains the "
            "samples it was given, one entry each, in their order"
        )
    tokens = [torch.as_tensor(t, dtype=torch.long).numpy() for t in data["tokens"]]
    lengths = [int(n) for n in data["response_lengths"]]
    masks = [torch.as_tensor(m, dtype=torch.float32).numpy() for m in data["loss_masks"]]
    for i, (row, n, mask) in enumerate(zip(tokens, lengths, masks, strict=True)):
        if not 0 <= n < len(row) or len(mask) != n:
            raise BatchError(
                f"{flag(name)}: sample {i} has {len(row)} tokens, response_length {n} and a loss mask "
                f"of {len(mask)}; the response is the last response_length tokens, one mask entry "
                "each"
            )
    logprobs = data.get("rollout_log_probs")
    if logprobs is None and lengths != batch.response_lengths():  # the engine's no longer match the responses
        logprobs = [np.zeros(n, np.float32) for n in lengths]
    if logprobs is not None:
        batch.rollout_logprobs = [np.asarray(lp, np.float32) for lp in logprobs]
        if [len(lp) for lp in batch.rollout_logprobs] != lengths:
            raise BatchError(f"{flag(name)}: rollout_log_probs must have one entry per response token of each sample")
    batch.tokens, batch.loss_masks = tokens, masks
    batch.prompt_lengths = [len(t) - n for t, n in zip(tokens, lengths, strict=True)]
    batch.raw_rewards_B = _rewards(data.get("raw_reward", data["rewards"]), len(samples), name, "raw_reward")
    batch.rewards_B = _rewards(data["rewards"], len(samples), name, "rewards")
    batch.normalized = True
    return batch
