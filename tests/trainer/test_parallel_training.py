"""Parallel training under torchrun over gloo, against the same run in one process: TP=2 (vocab-parallel log-probs,
TP-aware gradient clipping) and DP=2 (each rank its part of the batch, gradients summed) end two steps with the
parameters of TP=1, DP=1. AdamW's epsilon is raised (1e-3) so that gradients that are zero up to rounding, which
differ in sign between the runs, do not become full-size updates: what is compared is the training, not the noise."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.trainer.hf_names import merge_tp_shards
from tests.trainer.conftest import trainer_args, weights

REPO = Path(__file__).parents[2]
STEPS = ["--num-rollout", "2", "--adam-eps", "1e-3"]


def _torchrun(args: list[str], log: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "services.trainer", *args[1:]]  # fmt: skip
    with log.open("w") as out:
        result = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out,
                                stderr=subprocess.STDOUT, timeout=300)  # fmt: skip
    assert result.returncode == 0, log.read_text()[-4000:]


@pytest.fixture
def single(filled_buffer, service_process, model, tmp_path):
    proc = service_process(*trainer_args(model, filled_buffer("one"), tmp_path / "one", *STEPS))
    assert proc.wait(timeout_s=240) == 0, proc.log
    return weights(tmp_path / "one", 2)


def test_tp2_training_equals_tp1(single, filled_buffer, model, tmp_path):
    args = trainer_args(model, filled_buffer("tp"), tmp_path / "tp", *STEPS, "--tensor-model-parallel-size", "2")
    _torchrun(args, tmp_path / "tp.log")
    shards = [torch.load(tmp_path / "tp" / "iter_0000002" / f"mp_rank_{r:02d}_000.pt", weights_only=False)["model"]
              for r in range(2)]  # fmt: skip
    for name, expected in single.items():
        if isinstance(expected, torch.Tensor):
            merged = merge_tp_shards(name, [shard[name] for shard in shards])
            torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-4, msg=name)


def test_dp2_training_equals_dp1(single, filled_buffer, model, tmp_path):
    _torchrun(trainer_args(model, filled_buffer("dp"), tmp_path / "dp", *STEPS), tmp_path / "dp.log")
    for name, expected in weights(tmp_path / "dp", 2).items():
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(expected, single[name], atol=1e-5, rtol=1e-4, msg=name)


def test_pp2_training_equals_pp1(single, filled_buffer, model, tmp_path):
    """Two pipeline stages (one layer each) through Megatron's 1F1B schedule over gloo."""
    args = trainer_args(model, filled_buffer("pp"), tmp_path / "pp", *STEPS, "--pipeline-model-parallel-size", "2",
                        "--micro-batch-size", "2")  # fmt: skip
    _torchrun(args, tmp_path / "pp.log")
    stages = [torch.load(tmp_path / "pp" / "iter_0000002" / f"mp_rank_00_{r:03d}.pt", weights_only=False)["model"]
              for r in range(2)]  # fmt: skip
    merged = {}
    for stage, state in enumerate(stages):  # local layer 0 of stage s is global layer s (one layer per stage)
        for name, value in state.items():
            merged[name.replace("decoder.layers.0.", f"decoder.layers.{stage}.")] = value
    for name, expected in single.items():
        if isinstance(expected, torch.Tensor):
            torch.testing.assert_close(merged[name], expected, atol=1e-5, rtol=1e-4, msg=name)
