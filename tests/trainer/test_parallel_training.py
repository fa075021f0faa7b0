"""Parallel training under torchrun over gloo, against the same run in one process: TP=2 (vocab-parallel log-probs,
TP-aware gradient clipping) and DP=2 (each rank its part of the batch, gradients summed) end two steps with the
parameters of TP=1, DP=1. AdamW's epsilon is raised (1e-3) so that gradients that are zero up to rounding, which
differ in sign between the runs, do not become full-size updates: what is compared is the training, not the noise."""

import pytest
import torch

from services.trainer.hf_names import merge_tp_shards
from tests.trainer.conftest import trainer_args, weights

STEPS = ["--num-rollout", "2", "--adam-eps", "1e-3"]


@pytest.fixture
def torchrun(service_process):
    def run(args: list[str]) -> None:
        proc = service_process(*args, nproc=2)
        assert proc.wait(timeout_s=300) == 0, proc.log[-4000:]

    return run


@pytest.fixture
def single(filled_buffer, service_process, model, tmp_path):
    proc = service_process(*trainer_args(model, filled_buffer("one"), tmp_path / "one", *STEPS))
    assert proc.wait(timeout_s=240) == 0, proc.log
    return weights(tmp_path / "one", 2)


def test_tp2_training_equals_tp1(single, filled_buffer, model, tmp_path, torchrun):
    args = trainer_args(model, filled_buffer("tp"), tmp_path / "tp", *STEPS, "--tensor-model-parallel-size", "2")
    torchrun(args)
    shards = [torch.load(tmp_path / "tp" / "iter_0000002" / f"mp_rank_{r:02d}_000.pt", weights_only=False)["model"]
              for r in range(2)]  # fmt: skip
    for name, expected in single.items():
        if isinstance(expected, torch.Tensor):
            merged = merge_tp_shards(name, [shard[name] for shard in shards])
            torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-4, msg=name)


def test_dp2_training_equals_dp1(single, filled_buffer, model, tmp_path, torchrun):
    torchrun(trainer_args(model, filled_buffer("dp"), tmp_path / "dp", *STEPS))
    for name, expected in weights(tmp_path / "dp", 2).items():
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(expected, single[name], atol=1e-5, rtol=1e-4, msg=name)


def test_pp2_training_equals_pp1(single, filled_buffer, model, tmp_path, torchrun):
    """Two pipeline stages (one layer each) through Megatron's 1F1B schedule over gloo."""
    args = trainer_args(model, filled_buffer("pp"), tmp_path / "pp", *STEPS, "--pipeline-model-parallel-size", "2",
                        "--micro-batch-size", "2")  # fmt: skip
    torchrun(args)
    stages = [torch.load(tmp_path / "pp" / "iter_0000002" / f"mp_rank_00_{r:03d}.pt", weights_only=False)["model"]
              for r in range(2)]  # fmt: skip
    merged = {}
    for stage, state in enumerate(stages):  # local layer 0 of stage s is global layer s (one layer per stage)
        for name, value in state.items():
            merged[name.replace("decoder.layers.0.", f"decoder.layers.{stage}.")] = value
    for name, expected in single.items():
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(merged[name], expected, atol=1e-5, rtol=1e-4, msg=name)
