"""`slipstream train` on GPUs at a realistic size: a Qwen3-0.6B-shaped bf16 model (random weights, built here)
trains with the engine on GPU 0 and the trainer on GPU 1, synchronous and with one step of overlap, its weights
reaching the engine after every step over NCCL; and colocated on one GPU. Also a smoke run of the weight-sync
benchmark (two GPUs).

`make test-gpu` runs these with the other `gpu` tests; the recipe for the lent GPU machines is in
docs/development.md. Each run prints its step split (rollout / reward / train / sync / other).
"""

import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_train import steps_of

REPO = Path(__file__).resolve().parents[1]
STEPS = 10
SETTINGS = [
    "--bf16", "--num-rollout", str(STEPS),
    "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--global-batch-size", "64", "--micro-batch-size", "8",
    "--rollout-max-response-len", "128", "--rollout-temperature", "1.0", "--rm-type", "random", "--lr", "1e-6",
    "--advantage-estimator", "grpo", "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
    "--stall-timeout-s", "600", "--sglang-max-running-requests", "64",
]  # fmt: skip

needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.fixture(scope="module")
def model_and_data(tmp_path_factory) -> tuple[Path, Path]:
    from services.train.demo import write_data
    from services.train.tiny_checkpoint import QWEN3_0_6B, write_tiny_model

    folder = tmp_path_factory.mktemp("qwen3-0.6b")
    model = write_tiny_model(folder / "model", dtype="bfloat16", lm_head_scale=1.0, **QWEN3_0_6B)
    train, _ = write_data(folder / "data")
    return model, train


LAYOUTS = {  # name: (GPUs needed, flags)
    "sync": (2, ["--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1"]),
    "async1": (2, ["--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1", "--async-buffer-size", "1"]),
    # through a weight receiver beside the engine (its GPU): NCCL to the receiver, CUDA IPC into the engine
    "streamed": (2, ["--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1",
                     "--weight-receiver-port-offset", "1"]),
    # an HF checkpoint per sync under the test's folder, reloaded by the engine (/update_weights_from_disk)
    "disk": (2, ["--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1", "--update-weight-transport", "disk",
                 "--update-weight-disk-dir", "{tmp}/weights"]),
    "colocated": (1, ["--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1", "--colocate"]),
    # the engine keeps its memory (and its decode graphs) while the trainer trains
    "colocated-resident": (1, ["--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1", "--colocate",
                               "--no-offload-rollout"]),
    "colocated-2gpu": (2, ["--rollout-num-gpus", "2", "--actor-num-gpus-per-node", "2", "--colocate",
                           "--use-distributed-optimizer"]),
    # a Qwen3-MoE-shaped model (moe_model below), its experts split over the trainer's two ranks
    "moe-ep2-colocated": (2, ["--rollout-num-gpus", "2", "--actor-num-gpus-per-node", "2", "--colocate",
                              "--expert-model-parallel-size", "2"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    """Qwen3-30B-A3B's attention and router (renormalised top-8) with 64 of its experts, in 4 layers: 1.3 B
    parameters."""
    from services.train.tiny_checkpoint import write_tiny_model

    folder = tmp_path_factory.mktemp("qwen3-moe")
    shape = dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
                 moe_intermediate_size=768, rope_theta=1000000.0, rms_norm_eps=1e-6)  # fmt: skip
    return write_tiny_model(folder / "model", num_layers=4, hidden_size=2048, dtype="bfloat16", lm_head_scale=1.0,
                            arch="qwen3_moe", **shape)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_qwen3_0_6b_shaped_model_trains_and_syncs(service_process, tmp_path, model_and_data, layout, request):
    """sync and async1: the engine on GPU 0, the trainer on GPU 1, weights over NCCL; colocated: both on GPU 0, the
    engine freeing its memory while the trainer trains (colocated-resident: keeping it), weights as CUDA IPC handles;
    colocated-2gpu: two trainer ranks (data-parallel, the distributed optimizer) and two engines on GPUs 0 and 1, each
    engine reading the handles of the rank on its GPU; moe-ep2-colocated: the same with a Qwen3-MoE-shaped model, each
    rank holding half of every layer's experts (all of them reach each engine)."""
    gpus, flags = LAYOUTS[layout]
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    model, train = model_and_data
    if layout.startswith("moe"):
        model = request.getfixturevalue("moe_model")
    where = ["--output-dir", str(tmp_path), "--run-id", layout, *flags]
    run = service_process("train", "--hf-checkpoint", str(model), "--prompt-data", str(train), *where, *SETTINGS)
    code = run.wait(840)
    run_dir = tmp_path / layout
    logs = {name: (run_dir / "logs" / f"{name}.log").read_text() for name in ("trainer", "rollout")}
    assert code == 0, run.log[-3000:] + logs["trainer"][-3000:] + logs["rollout"][-3000:]
    steps = steps_of(run_dir)
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert [s["policy_version"] for s in steps] == list(range(1, STEPS + 1))
    engines = int(flags[flags.index("--rollout-num-gpus") + 1])
    for version in range(1, STEPS + 1):  # every step's weights reached the engines, which serve them
        assert f"weights of version {version} sent to {engines} engine(s)" in logs["trainer"]
        assert (f"sent to {engines} engine(s) (streamed)" in logs["trainer"]) == (layout == "streamed")
        assert (f"sent to {engines} engine(s) (disk)" in logs["trainer"]) == (layout == "disk")
        assert f"weights of version {version} are live on {engines} engine(s)" in logs["rollout"]
    assert "starting over" not in logs["trainer"]  # no engine failed a sync
    if "--colocate" in flags:
        resident = "--no-offload-rollout" in flags
        assert ("engines keep (--no-offload-rollout) their GPU memory" in logs["trainer"]) == resident
    print(f"\n{layout}: {STEPS} steps of 8 prompts x 8 samples, 128-token responses; {torch.cuda.get_device_name(0)}")
    print(split_table(steps[2:]))


def split_table(steps: list[dict]) -> str:
    from services.train.report import split_times

    splits = [split_times(s["metrics"]) for s in steps]
    step_s = statistics.median(s["metrics"]["step_s"] for s in steps)
    cells = [f"{statistics.median(sp[k] for sp in splits) * 1e3:.0f}" for k in splits[0]]
    return (f"| step ms (median) | {' | '.join(splits[0])} |\n|---|{'---|' * len(splits[0])}\n"
            f"| {step_s * 1e3:.0f} | {' | '.join(cells)} |")  # fmt: skip


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.timeout(600)
def test_the_weight_sync_benchmark_runs(tmp_path):
    command = [sys.executable, "bench/weight_sync.py", "--shape", "qwen3-0.6b", "--bucket-mib", "512", "--syncs", "2"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| end to end, per-tensor | 512 MiB |" in result.stdout
    print(result.stdout[result.stdout.index("Weight sync") :])
