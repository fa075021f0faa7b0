"""`slipstream train` on a model whose weights and AdamW state do not fit one GPU: a Qwen3-8B-shaped bf16 model
(random weights, 8.2 B parameters: 16 GB of weights, 33 GB of float32 masters, 66 GB of Adam moments, and the
gradients: over 140 GB) trained with tensor parallelism and megatron's distributed optimizer, colocated with the
engines on the same GPUs, its weights synced to the engines after every step.

Prints per step the time split, tokens/s and MFU (the trainer's own metrics), and the peak memory of each GPU
(nvidia-smi, sampled every 0.5 s: trainer and engine together).

Run (2 GPUs):  python bench/large_model.py --shape qwen3-8b
Run (CPU, a tiny model, to check the script): .venv/bin/python bench/large_model.py --shape tiny --gpus 2
"""

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.tiny_checkpoint import write_tiny_model
from services.train.demo import write_data

SHAPES = {  # Qwen3-8B: 36 layers, untied embeddings
    "qwen3-8b": dict(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128),
}  # fmt: skip
SETTINGS = [
    "--bf16", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
    "--micro-batch-size", "2", "--rollout-max-response-len", "64", "--rm-type", "random", "--lr", "1e-6",
    "--advantage-estimator", "grpo", "--input-key", "prompt", "--label-key", "label", "--apply-chat-template",
    "--stall-timeout-s", "600", "--startup-timeout-s", "900",
]  # fmt: skip


class PeakMemory(threading.Thread):
    """Each GPU's highest used memory (MiB) while the run lasts."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak: dict[int, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, check=False).stdout  # fmt: skip
            for line in out.splitlines():
                index, used = (int(x) for x in line.split(","))
                self.peak[index] = max(self.peak.get(index, 0), used)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    parser.add_argument("--gpus", type=int, default=2, help="trainer ranks and engines, all on the same GPUs")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2, help="--tensor-model-parallel-size")
    args = parser.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    folder = Path(tempfile.mkdtemp(prefix="large-model-"))
    with torch.device("cuda" if cuda else "cpu"):  # random init of 8 B parameters: seconds on a GPU
        model = write_tiny_model(folder / "model", dtype="bfloat16", lm_head_scale=1.0, **SHAPES[args.shape])
    torch.cuda.empty_cache() if cuda else None
    train, _ = write_data(folder / "data")
    flags = ["--hf-checkpoint", str(model), "--prompt-data", str(train), "--output-dir", str(folder), "--run-id",
             "run", "--num-rollout", str(args.steps), "--actor-num-gpus-per-node", str(args.gpus),
             "--rollout-num-gpus", str(args.gpus), "--colocate", "--use-distributed-optimizer",
             "--tensor-model-parallel-size", str(args.tp), *SETTINGS]  # fmt: skip
    memory = PeakMemory()
    if shutil.which("nvidia-smi"):
        memory.start()
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "slipstream", "train", *flags], capture_output=True, text=True)
    memory.done.set()
    if result.returncode:
        logs = folder / "run" / "logs"
        tails = {p.name: p.read_text()[-2500:] for p in logs.glob("*.log")} if logs.exists() else {}
        raise SystemExit(f"slipstream train failed:\n{result.stderr[-3000:]}\n{json.dumps(tails, indent=1)}")
    steps = [json.loads(line) for line in (folder / "run" / "steps.jsonl").read_text().splitlines()]
    device = torch.cuda.get_device_name(0) if cuda else platform.processor() or "CPU"
    print(f"\n{args.shape}, TP={args.tp}, {args.gpus} trainer ranks and {args.gpus} engines colocated, distributed "
          f"optimizer; {device}; {time.strftime('%Y-%m-%d')}; run {time.monotonic() - started:.0f} s")  # fmt: skip
    print(
        f"command: python bench/large_model.py --shape {args.shape} --gpus {args.gpus} --tp {args.tp} "
        f"--steps {args.steps}\n"
    )
    print("| step | step s | train s | sync s | tokens/s | MFU |")
    print("|---|---|---|---|---|---|")
    for step in steps:
        m = step["metrics"]
        print(f"| {step['step']} | {m['step_s']:.1f} | {m['train_s']:.1f} | {m['sync_s']:.2f} | "
              f"{m.get('tokens_per_s', 0):.0f} | {m.get('mfu', 0):.1%} |")  # fmt: skip
    if memory.peak:
        print("\npeak memory per GPU (trainer and engine): "
              + ", ".join(f"GPU {i}: {mib / 1024:.1f} GiB" for i, mib in sorted(memory.peak.items())))  # fmt: skip


if __name__ == "__main__":
    main()
