"""From one rollout's samples to optimizer steps and micro-batches on this data-parallel rank.

A rollout of `rollout_batch_size` prompts * `n_samples_per_prompt` samples is trained as `num_steps_per_rollout`
optimizer steps of `global_batch_size` samples (slime's constraint). On each rank a step's samples are cut into
micro-batches of `micro_batch_size` samples, or, with dynamic batching, of as many samples as fit in
`max_tokens_per_gpu` tokens after padding; samples are sorted by length first so that padding stays small.
"""

from dataclasses import dataclass


class BatchSizeError(ValueError):
    """Batch sizes that do not fit together; the message names the numbers and what to change."""


@dataclass(frozen=True)
class BatchSizes:
    rollout_batch_size: int
    n_samples_per_prompt: int
    global_batch_size: int
    num_steps_per_rollout: int
    dp_size: int
    micro_batch_size: int

    def check(self) -> None:
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if samples != self.global_batch_size * self.num_steps_per_rollout:
            raise BatchSizeError(
                f"rollout_batch_size * n_samples_per_prompt = {self.rollout_batch_size} * {self.n_samples_per_prompt}"
                f" = {samples} samples per rollout, but global_batch_size * num_steps_per_rollout = "
                f"{self.global_batch_size} * {self.num_steps_per_rollout} = "
                f"{self.global_batch_size * self.num_steps_per_rollout}; make them equal, e.g. --global-batch-size "
                f"{samples // self.num_steps_per_rollout if samples % self.num_steps_per_rollout == 0 else samples}"
            )
        if self.global_batch_size % self.dp_size:
            raise BatchSizeError(
                f"global_batch_size {self.global_batch_size} is not divisible by the data-parallel size "
                f"{self.dp_size}; use a multiple of {self.dp_size}"
            )
        if self.rollout_batch_size % self.dp_size:
            raise BatchSizeError(
                f"rollout_batch_size {self.rollout_batch_size} is not divisible by the data-parallel size "
                f"{self.dp_size} (each rank trains whole prompt groups); use a multiple of {self.dp_size}"
            )
        per_rank = self.global_batch_size // self.dp_size
        if per_rank % self.micro_batch_size:
            raise BatchSizeError(
                f"each rank's part of a step ({per_rank} samples = global_batch_size {self.global_batch_size} / "
                f"{self.dp_size} ranks) is not divisible by micro_batch_size {self.micro_batch_size}"
            )


def split_steps(items: list, num_steps: int) -> list[list]:
    """One rollout's items (this rank's samples, in order) as `num_steps` consecutive, equal parts."""
    if len(items) % num_steps:
        raise BatchSizeError(f"{len(items)} samples on this rank do not split into {num_steps} equal steps")
    size = len(items) // num_steps
    return [items[i * size : (i + 1) * size] for i in range(num_steps)]


def micro_batches(lengths: list[int], micro_batch_size: int | None, max_tokens: int | None) -> list[list[int]]:
    """Indices of the samples of each micro-batch, longest first. Fixed size when `max_tokens` is None; otherwise
    greedy: a micro-batch grows while (its samples) * (its longest length) stays within `max_tokens`."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if max_tokens is None:
        size = micro_batch_size or 1
        return [order[i : i + size] for i in range(0, len(order), size)]
    too_long = [lengths[i] for i in order if lengths[i] > max_tokens]
    if too_long:
        raise BatchSizeError(f"a sample of {too_long[0]} tokens does not fit --max-tokens-per-gpu {max_tokens}")
    batches: list[list[int]] = []
    for index in order:  # longest first: the first sample of a micro-batch sets its padded length
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def padding_ratio(lengths: list[int], batches: list[list[int]]) -> float:
    """Padded positions over all positions: what padding costs in compute."""
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1 - sum(lengths) / padded if padded else 0.0
