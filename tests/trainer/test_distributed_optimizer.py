"""megatron-core's DDP and DistributedOptimizer (`--use-distributed-optimizer`) under torchrun over gloo: DP=2 (with
and without overlapped gradient reduction and weight gathering), DP=2 x TP=2, DP=2 x PP=2 and an MoE at DP=2 (with
and without EP=2) train like one process with torch's AdamW on the same batches, loss for loss, and a run saved after
two steps and resumed ends bit-identical to an uninterrupted one, each data-parallel rank holding its own optimizer
shard.

Tolerances (float32): losses and gradient norms rel 1e-5; weights atol 1e-5, rtol 1e-4, after four steps of warmup,
cosine decay, weight decay and clipping. They differ from one process only by the order of the data-parallel sums and
megatron's way of computing the gradient norm. AdamW's epsilon is raised (1e-3) as in test_parallel_training.py."""

import json

import pytest
import torch

from services.trainer.hf_names import merge_tp_shards
from tests.trainer.conftest import NUM_STEPS, trainer_args, weights

TRAINING = ["--adam-eps", "1e-3", "--clip-grad", "0.5", "--weight-decay", "0.1", "--lr-warmup-iters", "1",
            "--lr-decay-style", "cosine", "--lr-decay-iters", "4", "--min-lr", "1e-4"]  # fmt: skip
STEPS = ["--num-rollout", str(NUM_STEPS), *TRAINING]
SHARDED = ["--use-distributed-optimizer"]


def _train(service_process, args: list[str], steps_file, nproc: int) -> list[dict]:
    proc = service_process(*args, "--steps-file", str(steps_file), nproc=nproc)
    assert proc.wait(timeout_s=300) == 0, proc.log[-4000:]
    return [json.loads(line)["metrics"] for line in steps_file.read_text().splitlines()]


@pytest.fixture
def single(filled_buffer, service_process, model, tmp_path):
    """One process, torch's AdamW: the reference run."""
    args = trainer_args(model, filled_buffer("one"), tmp_path / "one", *STEPS)
    return _train(service_process, args, tmp_path / "steps-one.jsonl", 1), weights(tmp_path / "one", NUM_STEPS)


@pytest.mark.parametrize(
    "name, extra, nproc",
    [("dp2", [], 2),
     ("dp2-overlap", ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000"], 2),
     ("dp2-tp2", ["--tensor-model-parallel-size", "2"], 4),
     ("dp2-pp2", ["--pipeline-model-parallel-size", "2"], 4)],
)  # fmt: skip
def test_distributed_optimizer_trains_like_one_process(name, extra, nproc, single, filled_buffer, service_process,
                                                        model, tmp_path):  # fmt: skip
    expected_steps, expected = single
    args = trainer_args(model, filled_buffer(name), tmp_path / name, *STEPS, *SHARDED, *extra)
    steps = _train(service_process, args, tmp_path / f"steps-{name}.jsonl", nproc)
    assert any(step["grad_norm"] > 0.5 for step in expected_steps)  # clipping took part
    for step, reference in zip(steps, expected_steps, strict=True):
        for metric in ("loss", "grad_norm", "lr"):
            assert step[metric] == pytest.approx(reference[metric], rel=1e-5), (metric, step, reference)
    for tensor, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(_merged(tmp_path / name, name)[tensor], value, atol=1e-5, rtol=1e-4, msg=tensor)


def _merged(folder, name: str) -> dict:
    """The trained model in one piece from its TP shards, or its pipeline stages (one layer each)."""
    folder = folder / f"iter_{NUM_STEPS:07d}"
    if "tp2" in name:
        shards = [torch.load(folder / f"mp_rank_{r:02d}_000.pt", weights_only=False)["model"] for r in range(2)]
        return {tensor: merge_tp_shards(tensor, [shard[tensor] for shard in shards]) for tensor in shards[0]}
    merged = {}
    for stage in range(2 if "pp2" in name else 1):
        for tensor, value in torch.load(folder / f"mp_rank_00_{stage:03d}.pt", weights_only=False)["model"].items():
            merged[tensor.replace("decoder.layers.0.", f"decoder.layers.{stage}.")] = value
    return merged


@pytest.mark.parametrize("layout", [[], ["--expert-model-parallel-size", "2"]])
def test_distributed_optimizer_with_experts_trains_like_one_process(layout, filled_buffer, service_process, tmp_path):
    """Qwen3-MoE at DP=2: without expert parallelism megatron shards the experts with the other weights; with EP=2
    (each rank four of the eight experts) they have their own optimizer, and the norm it clips by spans both."""
    from services.train.tiny_checkpoint import write_tiny_model
    from tests.trainer.test_parallel_training import _experts_merged

    moe = write_tiny_model(tmp_path / "qwen3_moe", arch="qwen3_moe")
    steps = ["--num-rollout", "2", *TRAINING]
    expected_steps = _train(service_process, trainer_args(moe, filled_buffer("one"), tmp_path / "one", *steps),
                            tmp_path / "steps-one.jsonl", 1)  # fmt: skip
    args = trainer_args(moe, filled_buffer("two"), tmp_path / "two", *steps, *SHARDED, *layout)
    for step, reference in zip(_train(service_process, args, tmp_path / "steps-two.jsonl", 2), expected_steps,
                               strict=True):  # fmt: skip
        for metric in ("loss", "grad_norm", "load_balancing_loss"):
            assert step[metric] == pytest.approx(reference[metric], rel=1e-5), (metric, step, reference)
    shards = ["mp_rank_00_000_000.pt", "mp_rank_00_000_001.pt"] if layout else ["mp_rank_00_000.pt"]
    trained = _experts_merged(tmp_path / "two", shards)
    for tensor, value in weights(tmp_path / "one", 2).items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(trained[tensor], value, atol=1e-5, rtol=1e-4, msg=tensor)


# bf16: the float32 main weights are the optimizer's (float32 alone in `make test-slow`: the same path, fewer parts)
@pytest.mark.parametrize("precision", [pytest.param([], marks=pytest.mark.slow), ["--bf16"]])
def test_save_and_resume_is_bit_exact(precision, filled_buffer, service_process, model, tmp_path):
    """DP=2: four steps at once, against two steps, a save and a resume from it for two more."""
    sharded = [*SHARDED, *precision]
    straight = _train(service_process, trainer_args(model, filled_buffer("a"), tmp_path / "a", *STEPS, *sharded),
                      tmp_path / "steps-a.jsonl", 2)  # fmt: skip
    buffer = filled_buffer("b")
    half = ["--num-rollout", "2", *TRAINING, *sharded]
    _train(service_process, trainer_args(model, buffer, tmp_path / "b", *half), tmp_path / "steps-b.jsonl", 2)
    saved = tmp_path / "b" / "iter_0000002"
    assert sorted(p.name for p in saved.iterdir()) == ["mp_rank_00_000.pt", "mp_rank_00_000_optim_dp000.pt",
                                                       "mp_rank_00_000_optim_dp001.pt"]  # fmt: skip
    assert "optimizer" not in torch.load(saved / "mp_rank_00_000.pt", weights_only=False)
    resumed = _train(service_process, trainer_args(model, buffer, tmp_path / "b", *STEPS, *sharded, "--load",
                                                   str(tmp_path / "b")), tmp_path / "steps-b.jsonl", 2)  # fmt: skip
    assert [_trained(step) for step in resumed] == [_trained(step) for step in straight]
    for file in ("mp_rank_00_000.pt", "mp_rank_00_000_optim_dp000.pt", "mp_rank_00_000_optim_dp001.pt"):
        a, b = (torch.load(tmp_path / run / f"iter_{NUM_STEPS:07d}" / file, weights_only=False) for run in "ab")
        for state in (a, b):  # the trainer seeds torch's generators; Python's and numpy's start as each process's
            for unseeded in ("python", "numpy"):
                state.get("rng", {}).pop(unseeded, None)
        _assert_identical(a, b, file)


def _trained(metrics: dict) -> dict:
    """A step's metrics but its timings."""
    return {k: v for k, v in metrics.items() if not any(t in k for t in ("time", "_s", "per_s", "mfu"))}


def _assert_identical(a, b, where: str) -> None:
    """Every tensor of two checkpoint files bit for bit (RNG states and plain values equal)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_identical(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_slimes_data_parallel_flags_reach_the_trainer():
    """slime's scripts pass megatron's flags for DDP and the distributed optimizer: they go to the trainer, and
    overlapping the weights' gathering without the distributed optimizer, which has nothing to gather, is refused."""
    from services.common.config import load_config
    from services.train.options import route
    from services.trainer.config import TrainerConfig

    flags = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    assert route(["--optimizer", "adam", *flags])["trainer"] == flags
    assert load_config(TrainerConfig, flags, prog="trainer").overlap_param_gather
    with pytest.raises(ValueError, match=r"--overlap-param-gather .* add --use-distributed-optimizer"):
        TrainerConfig(overlap_param_gather=True)
