"""Group filters and selection (slime's dynamic sampling and buffer filter), and how their results are read.

A dynamic sampling filter runs when a group is submitted: fn(args, samples) returns a bool or an object with
`keep` and `reason` (slime's DynamicFilterOutput). A buffer filter picks a step's groups from the completed ones:
fn(args, rollout_id, buffer, num_samples) returns the chosen groups (each a list of samples).
"""

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class FilterOutput:
    keep: bool
    reason: str | None = None


def check_reward_nonzero_std(args, samples, **kwargs) -> FilterOutput:
    """Keeps groups whose rewards differ: a group where every sample scored the same teaches GRPO nothing."""
    rewards = [sample.reward for sample in samples]
    keep = len(rewards) > 1 and statistics.pstdev(rewards) > 0.0
    return FilterOutput(keep, None if keep else f"zero_std_{round(rewards[0], 1) if rewards else 'empty'}")


def read_verdict(result) -> FilterOutput:
    """Accepts a bool or anything with `keep` (and optionally `reason`)."""
    if isinstance(result, bool):
        return FilterOutput(result, None if result else "filtered")
    keep = bool(result.keep)
    return FilterOutput(keep, None if keep else (getattr(result, "reason", None) or "filtered"))
