"""The buffer's prompt groups as the trainer's tensors: each sample's tokens, its response span, loss mask, rollout
log-probs and reward, checked once when the batch arrives; micro-batches are right-padded `[B, L]` token tensors
and `[B, R]` response tensors (`R` the longest response), the layout `advantages.py` and `losses.py` use."""

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from slipstream import samples as arrays
from slipstream.v1 import common_pb2


class BatchError(ValueError):
    """A batch that cannot be trained on; the message names the group, the sample and the numbers."""


@dataclass
class RolloutBatch:
    """This rank's samples of one rollout, whole prompt groups of `group_size` consecutive samples."""

    tokens: list[np.ndarray]
    prompt_lengths: list[int]
    loss_masks: list[np.ndarray]
    rollout_logprobs: list[np.ndarray]
    rewards_B: torch.Tensor
    group_size: int
    sample_ids: list[str]
    routed_experts: list[bytes] | None = None  # the engines' routing per sample (int32), for rollout routing replay
    # The teacher's log-prob of each response token (on-policy distillation, --opd-type sglang); empty where a sample
    # has none (None: no sample has)
    teacher_logprobs: list[np.ndarray] | None = None
    raw_rewards_B: torch.Tensor | None = None  # the rewards as scored, where a hook has replaced `rewards_B`
    normalized: bool = False  # `rewards_B` is already normalized (by a custom reward post-processing or conversion)
    reward_failures: list[common_pb2.RewardError] = field(default_factory=list)  # each failed reward's

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def scored_rewards_B(self) -> torch.Tensor:
        return self.rewards_B if self.raw_rewards_B is None else self.raw_rewards_B

    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def response_lengths(self) -> list[int]:
        return [len(t) - p for t, p in zip(self.tokens, self.prompt_lengths, strict=True)]


def from_groups(groups: list[common_pb2.PromptGroup], group_size: int) -> RolloutBatch:
    tokens, prompts, masks, logprobs, rewards, ids, routed, teacher, failures = [], [], [], [], [], [], [], [], []
    for group in groups:
        if len(group.samples) != group_size:
            raise BatchError(f"group {group.group_id} has {len(group.samples)} samples, expected {group_size}")
        for sample in group.samples:
            where = f"group {group.group_id} sample {sample.index}"
            sample_tokens = arrays.decode_tokens(sample.tokens)
            mask = (
                arrays.decode_mask(sample.loss_mask) if sample.loss_mask else np.ones(sample.response_length, np.uint8)
            )
            lps = arrays.decode_logprobs(sample.rollout_logprobs)
            if len(sample_tokens) != sample.prompt_length + sample.response_length or sample.prompt_length < 1:
                raise BatchError(
                    f"{where}: {len(sample_tokens)} tokens, but prompt_length + response_length = "
                    f"{sample.prompt_length} + {sample.response_length}"
                )
            if len(mask) != sample.response_length or len(lps) not in (0, sample.response_length):
                raise BatchError(
                    f"{where}: loss_mask has {len(mask)} and rollout_logprobs {len(lps)} entries for "
                    f"{sample.response_length} response tokens"
                )
            teacher_lps = arrays.decode_logprobs(sample.teacher_logprobs)
            if len(teacher_lps) not in (0, sample.response_length):
                raise BatchError(
                    f"{where}: teacher_logprobs has {len(teacher_lps)} entries for {sample.response_length} response "
                    "tokens"
                )
            if not math.isfinite(sample.reward):
                raise BatchError(f"{where}: reward is {sample.reward}; fix the reward function or its --reward-key")
            if sample.status in (common_pb2.SAMPLE_STATUS_FAILED, common_pb2.SAMPLE_STATUS_ABORTED):
                mask = np.zeros_like(mask)  # kept for its group's statistics, not trained on
            if sample.status == common_pb2.SAMPLE_STATUS_FAILED:  # the gateway's mark of a reward that failed
                failures.append(_failure(sample, where))
            tokens.append(sample_tokens.astype(np.int64))
            prompts.append(sample.prompt_length)
            masks.append(mask.astype(np.float32))
            logprobs.append(lps if len(lps) else np.zeros(sample.response_length, np.float32))
            rewards.append(sample.reward)
            ids.append(sample.sample_id)
            routed.append(sample.routed_experts)
            teacher.append(teacher_lps)
    rewards_B = torch.tensor(rewards, dtype=torch.float32)
    teacher_or_none = teacher if any(len(t) for t in teacher) else None
    return RolloutBatch(
        tokens, prompts, masks, logprobs, rewards_B, group_size, ids, routed, teacher_or_none, reward_failures=failures
    )


def _failure(sample: common_pb2.Sample, where: str) -> common_pb2.RewardError:
    """Why the FAILED sample has no reward (a sample failed before it was scored: "generation")."""
    if sample.HasField("reward_error"):
        return sample.reward_error
    return common_pb2.RewardError(rm_type="generation", kind="failed", message=sample.status_message or where)


def pad_rows(rows: list[np.ndarray], width: int, dtype=torch.float32) -> torch.Tensor:
    """Right-padded `[len(rows), width]` with zeros."""
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(np.array(row, copy=True)).to(dtype)
    return out


def response_tensors(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    """The whole rank's `[B, R]` response tensors (for advantages, which need every sample of a group)."""
    width = max(batch.response_lengths(), default=0)
    return {
        "loss_mask_BR": pad_rows(batch.loss_masks, width),
        "rollout_logprobs_BR": pad_rows(batch.rollout_logprobs, width),
    }


def input_tensors(batch: RolloutBatch, indices: list[int]) -> dict[str, torch.Tensor]:
    """A micro-batch's model inputs: tokens `[b, L]` right-padded, positions, and where each response starts."""
    rows = [batch.tokens[i] for i in indices]
    width = max(len(r) for r in rows)
    return {
        "tokens_BL": pad_rows(rows, width, torch.long),
        "positions_BL": torch.arange(width).expand(len(rows), width).contiguous(),
        "prompt_lengths_B": torch.tensor([batch.prompt_lengths[i] for i in indices]),
        "lengths_B": torch.tensor([len(r) for r in rows]),
    }
