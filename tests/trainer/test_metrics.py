"""The trainer's step metrics: the rollout and reward parts of the wait for a batch against hand-computed unions, and
--steps-file's line per step, one file per data-parallel replica."""

import json
from types import SimpleNamespace

import torch

from services.trainer.config import TrainerConfig
from services.trainer.metrics import StepLog, rollout_times
from services.trainer.parallel import ParallelInfo


def _group(leased: float, generated: float, scored: float | None = None):
    timings = {"leased": leased, "generated": generated}
    if scored is not None:
        timings["scored"] = scored
    return SimpleNamespace(timings=timings)


def test_rollout_times_are_unions_within_the_wait():
    groups = [_group(0, 4, 6), _group(2, 5, 9), _group(7, 8, 20), _group(1, 3)]  # the last one is not scored yet
    # generating: [0, 5] and [7, 8] cut to the wait [1, 10] = 4 + 1; busy: [0, 10] cut to it = 9
    assert rollout_times(groups, since=1, until=10) == {"rollout_s": 5.0, "reward_s": 4.0}
    assert rollout_times([_group(0, 1)], since=0, until=1) == {}


def _info(rank: int, tp_rank: int = 0, dp_rank: int = 0) -> ParallelInfo:
    return ParallelInfo(rank=rank, world_size=4, tp_rank=tp_rank, tp_size=2, device=torch.device("cpu"),
                        dp_rank=dp_rank, dp_size=2)  # fmt: skip


def test_each_replica_writes_its_own_steps_file(tmp_path):
    config = TrainerConfig(steps_file=str(tmp_path / "steps.jsonl"))
    logs = [StepLog(config, _info(0)), StepLog(config, _info(1, tp_rank=1)), StepLog(config, _info(2, dp_rank=1))]
    for log in logs:
        log.record(3, 4, ["g1"], {"reward": 0.5})
        log.report(4, {"reward": 0.5})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["steps.dp1.jsonl", "steps.jsonl"]
    line = json.loads((tmp_path / "steps.jsonl").read_text())
    assert (line["step"], line["policy_version"], line["groups"], line["metrics"]) == (3, 4, ["g1"], {"reward": 0.5})
