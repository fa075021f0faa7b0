"""A step's failed rewards over every data-parallel rank: counted by reward type and kind for the step's metrics, the
first failure of each kind kept for the console, and the check that stops a run rather than train on failures."""

from dataclasses import dataclass, field

import torch.distributed as dist

from services.common.errors import RunStopped
from services.trainer.parallel import control_group
from slipstream.v1 import common_pb2


@dataclass
class RewardFailures:
    samples: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # "<rm_type>/<kind>": how many samples
    first: dict[str, common_pb2.RewardError] = field(default_factory=dict)  # the first failure of each

    def add(self, samples: int, failures: list[common_pb2.RewardError]) -> "RewardFailures":
        self.samples += samples
        for error in failures:
            key = f"{error.rm_type}/{error.kind}"
            self.counts[key] = self.counts.get(key, 0) + 1
            self.first.setdefault(key, error)
        return self

    @property
    def failed(self) -> int:
        return sum(self.counts.values())

    def metrics(self) -> dict[str, float]:
        """`reward_failed` (the share of the step's samples) and `reward_errors/<rm_type>/<kind>` (counts)."""
        counts = {f"reward_errors/{key}": float(n) for key, n in sorted(self.counts.items())}
        return {"reward_failed": self.failed / max(1, self.samples), **counts}

    def firsts(self) -> dict[str, dict]:
        """The first failure of each kind, as the step's line of --steps-file carries it to the console."""
        return {key: {"message": e.message, "traceback": e.traceback} for key, e in self.first.items()}

    def over(self, max_share: float) -> bool:
        return self.failed > max_share * self.samples

    def stop(self, step: int, max_share: float, then: str) -> RunStopped:
        """The sentence the run stops with; `then` says what to do next."""
        first = next(iter(self.first.values()))
        return RunStopped(
            f"step {step}: the reward failed for {self.failed} of {self.samples} samples (more than "
            f"--max-reward-failures {max_share:g}), e.g. {first.message}; {then}"
        )


def gather(dp_rank: int, samples: int, failures: list[common_pb2.RewardError]) -> RewardFailures:
    """The step's failures over every data-parallel rank (each rank's once: its tensor- and pipeline-parallel peers
    hold the same samples), the same on every rank, so that every rank takes the same decision."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return RewardFailures().add(samples, failures)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (dp_rank, samples, failures), group=control_group())
    total = RewardFailures()
    for _, count, errors in {part[0]: part for part in parts}.values():
        total.add(count, errors)
    return total
