"""GPU checks (skipped without two GPUs): sequence parallelism over NCCL trains like plain tensor parallelism, two
pipeline stages through Megatron's schedule (batched NCCL p2p) train like one GPU, and so do two expert-parallel
ranks of an MoE model (tokens to their experts by NCCL all-to-all) and two data-parallel ranks with megatron's
distributed optimizer (gradients reduce-scattered, weights all-gathered over NCCL).

Run on a machine with 2 GPUs: `python -m pytest tests/trainer/test_gpu.py -m gpu`.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.processes import free_port

REPO = Path(__file__).parents[2]


def _run(model: Path, out: Path, layout: str) -> None:
    port = free_port()
    procs = "1" if layout == "single" else "2"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", procs, "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "tests.trainer.test_gpu", str(model), str(out), layout]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sequence_parallel_trains_like_tensor_parallel(tmp_path):
    from services.train.tiny_checkpoint import write_tiny_model

    model = write_tiny_model(tmp_path / "model", hidden_size=128)
    _run(model, tmp_path / "tp", "tp2")
    _run(model, tmp_path / "sp", "tp2sp")
    for rank in range(2):
        plain, split = (torch.load(tmp_path / name / f"rank{rank}.pt") for name in ("tp", "sp"))
        for name, value in plain.items():
            torch.testing.assert_close(split[name], value, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_pipeline_stages_train_like_one_gpu(tmp_path):
    from services.train.tiny_checkpoint import write_tiny_model

    model = write_tiny_model(tmp_path / "model", hidden_size=128)
    _run(model, tmp_path / "one", "single")
    _run(model, tmp_path / "pp", "pp2")
    single = torch.load(tmp_path / "one" / "rank0.pt")
    merged = {}
    for stage in range(2):  # one layer per stage: local layer 0 of stage s is global layer s
        for name, value in torch.load(tmp_path / "pp" / f"rank{stage}.pt").items():
            merged[name.replace("decoder.layers.0.", f"decoder.layers.{stage}.")] = value
    assert sorted(merged) == sorted(single)
    for name, value in single.items():
        torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_expert_parallel_ranks_train_like_one_gpu(tmp_path):
    """Each rank trains the same batch (so the step equals one GPU's) with four of the eight experts of each layer."""
    from services.train.tiny_checkpoint import write_tiny_model

    model = write_tiny_model(tmp_path / "model", hidden_size=128, arch="qwen3_moe")
    _run(model, tmp_path / "one", "single")
    _run(model, tmp_path / "ep", "ep2")
    single = torch.load(tmp_path / "one" / "rank0.pt")
    merged = {}
    for rank in range(2):  # rank r's local expert j is expert 4 r + j
        for name, value in torch.load(tmp_path / "ep" / f"rank{rank}.pt").items():
            head, _, rest = name.partition("local_experts.")
            if rest:
                expert, tail = rest.split(".", 1)
                name = f"{head}local_experts.{4 * rank + int(expert)}.{tail}"
            merged[name] = value
    assert sorted(merged) == sorted(single)
    for name, value in single.items():
        torch.testing.assert_close(merged[name], value, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_ranks_with_the_distributed_optimizer_train_like_one_gpu(tmp_path):
    """Each rank trains the same batch, so the step equals one GPU's; each keeps and steps half of AdamW's state."""
    from services.train.tiny_checkpoint import write_tiny_model

    model = write_tiny_model(tmp_path / "model", hidden_size=128)
    _run(model, tmp_path / "one", "single")
    _run(model, tmp_path / "dp", "dp2-sharded")
    single = torch.load(tmp_path / "one" / "rank0.pt")
    for rank in range(2):
        trained = torch.load(tmp_path / "dp" / f"rank{rank}.pt")
        for name, value in single.items():
            torch.testing.assert_close(trained[name], value, atol=1e-5, rtol=1e-4, msg=name)


def _worker(model: str, out: Path, layout: str) -> None:
    """One rank: a trainer (TP=2 ± sequence parallelism, PP=2, or one GPU) trains two steps on a fixed batch."""
    import numpy as np

    from services.trainer.config import TrainerConfig
    from services.trainer.data import RolloutBatch
    from services.trainer.loop import Trainer

    parallel = {"tp2": {"tensor_model_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2}, "single": {},
                "tp2sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
                "ep2": {"expert_model_parallel_size": 2},
                "dp2-sharded": {"use_distributed_optimizer": True, "overlap_grad_reduce": True}}[layout]  # fmt: skip
    config = TrainerConfig(hf_checkpoint=model, rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8,
                           micro_batch_size=2, lr=1e-3, adam_eps=1e-3, **parallel)  # fmt: skip
    trainer = Trainer(config)
    rng = np.random.default_rng(0)
    lengths = rng.integers(9, 40, size=8)
    batch = RolloutBatch(
        tokens=[rng.integers(5, 400, size=int(n)) for n in lengths], prompt_lengths=[4] * 8,
        loss_masks=[np.ones(int(n) - 4, np.float32) for n in lengths],
        rollout_logprobs=[np.zeros(int(n) - 4, np.float32) for n in lengths],
        rewards_B=torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0]), group_size=4, sample_ids=[str(i) for i in range(8)],
    )  # fmt: skip
    for _ in range(2):
        trainer.actor.train_rollout(batch)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}
    torch.save(state, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
    os._exit(0)
