"""`slipstream demo`: a tiny Qwen3-architecture model (random weights, a real tokenizer and chat template) learns
"the larger of two digits" from scratch with GRPO through the whole system, on a CPU, in a few minutes.

The prompt is two distinct digits, e.g. "3 7"; the answer is one token, and the reward (the reward service's
`exact`) is 1 when it is the larger digit. Ten pairs are held out of training and make the eval set. The tokenizer is
learnt from the task's own text (64 tokens), so a random model starts near 1/64 and can find the digits by sampling.
"""

import argparse
import itertools
import json
import os
import random
import shutil
import sys
from pathlib import Path

from services.train.run import main as train_main

HELD_OUT = {(1, 8), (8, 1), (2, 6), (6, 2), (3, 9), (9, 3), (4, 5), (5, 4), (0, 7), (7, 0)}
# Calibrated on the 2-core CPU machine: see docs/BENCHMARKS.md ("The demo").
SETTINGS = {
    "--rollout-batch-size": "32", "--n-samples-per-prompt": "8", "--global-batch-size": "256",
    "--micro-batch-size": "256", "--lr": "1e-3", "--adam-beta2": "0.98", "--clip-grad": "1.0",
    "--rollout-max-response-len": "1", "--rollout-temperature": "1.0", "--rm-type": "exact",
    "--advantage-estimator": "grpo", "--n-samples-per-eval-prompt": "8", "--num-data-workers": "0",
    "--num-workers": "1", "--sglang-max-running-requests": "256",
}  # fmt: skip


def write_data(folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """Training prompts (every pair not held out, shuffled, repeated) and the held-out eval prompts, as JSONL."""
    folder.mkdir(parents=True, exist_ok=True)
    pairs = [p for p in itertools.permutations(range(10), 2) if p not in HELD_OUT]
    rows = [_row(a, b) for a, b in pairs] * 200
    random.Random(seed).shuffle(rows)
    train, evaluation = folder / "train.jsonl", folder / "eval.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    evaluation.write_text("".join(json.dumps(_row(a, b)) + "\n" for a, b in sorted(HELD_OUT)))
    return train, evaluation


def _row(a: int, b: int) -> dict:
    return {"prompt": [{"role": "user", "content": f"{a} {b}"}], "label": str(max(a, b))}


def prepare(folder: Path, arch: str = "qwen3") -> tuple[Path, Path, Path]:
    """The tiny model (of family `arch`) and the data under `folder` (built once): (model, train.jsonl, eval.jsonl)."""
    from services.train.tiny_checkpoint import write_tiny_model

    model = folder / "model"
    if not (model / "config.json").exists():
        print(f"writing the tiny model to {model} and its data to {folder / 'data'}", flush=True)
        text = [
            f"<|im_start|>user\n{a} {b}<|im_end|>\n<|im_start|>assistant\n{max(a, b)}<|im_end|>\n"
            for a, b in itertools.permutations(range(10), 2)
        ]
        write_tiny_model(model, num_layers=2, hidden_size=64, corpus=text, vocab_size=64, lm_head_scale=1.0, arch=arch)
    return (model, *write_data(folder / "data"))


def train_args(
    folder: Path, steps: int, async_buffer_size: int = 0, run_id: str = "demo", arch: str = "qwen3"
) -> list[str]:
    """The `slipstream train` command line of the demo."""
    model, train, evaluation = prepare(folder, arch)
    args = ["--hf-checkpoint", str(model), "--prompt-data", str(train), "--input-key", "prompt", "--label-key",
            "label", "--apply-chat-template", "--eval-prompt-data", "held_out", str(evaluation),
            "--num-rollout", str(steps), "--eval-interval", str(max(1, steps // 5)), "--output-dir", str(folder),
            "--run-id", run_id, "--save", str(folder / run_id / "checkpoints"), "--save-interval", "25"]  # fmt: skip
    if async_buffer_size:
        args += ["--async-buffer-size", str(async_buffer_size)]
    return args + [x for item in SETTINGS.items() for x in item]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slipstream demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("runs"), help="the demo's folder (default: runs)")
    parser.add_argument("--steps", type=int, default=150, help="training steps (default: 150)")
    parser.add_argument("--async-buffer-size", type=int, default=0, help="staleness bound (0: synchronous)")
    parser.add_argument("--prepare-only", action="store_true", help="write the model and the data, print their paths")
    args, extra = parser.parse_known_args(argv)
    if args.prepare_only:
        for name, path in zip(("model", "train", "eval"), prepare(args.output_dir), strict=True):
            print(f"{name}: {path}")
        return 0
    run_id = "demo" if not args.async_buffer_size else f"demo-async{args.async_buffer_size}"
    if args.async_buffer_size and not shutil.which("nvidia-smi"):  # engine and trainer run at once: a core each
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    shutil.rmtree(args.output_dir / run_id, ignore_errors=True)  # the demo always starts over
    print(f"slipstream demo: {args.steps} steps of 32 prompts x 8 samples; the run goes to {args.output_dir / run_id}")
    command = train_args(args.output_dir, args.steps, args.async_buffer_size, run_id) + extra
    # The services load torch and the model before the first step: half a minute without a line of their own.
    print("starting the services (Redis, buffer, reward, gateway, engine, trainer): ~30 s to step 0", flush=True)
    return train_main(command)


if __name__ == "__main__":
    sys.exit(main())
