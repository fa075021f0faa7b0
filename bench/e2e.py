"""The demo end to end, synchronous against `--async-buffer-size 1`: where a step's time goes.

Each mode is one `slipstream train` run of the demo (every service a process). Per step, from the trainer's
--steps-file: the time it waited for the batch split into rollout (its groups were being generated, seen from the
gateway, HTTP to the engines included) and reward (being scored, the Score call included) and the rest of the wait;
train (the optimizer step, old log-probs included); sync (weights to the engines, commit included). "glue" is what
is left of the step: leasing, submitting and fetching the batch over gRPC, Redis, (de)serialisation, scheduling.
With overlap, generation that happens while the trainer trains does not count: only the waiting that is left.

With --batch-sizes, each mode runs once per batch size (prompts per step, 8 samples each; the optimizer takes the
whole batch in one step, as the demo does): how the split grows with the batch.

    python bench/e2e.py [--steps 60] [--skip 5] [--batch-sizes 32] [slipstream train options, e.g.
        --rollout-num-gpus 1 on GPUs]
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.redis_connection import EmbeddedRedis
from services.train.demo import SETTINGS, train_args
from services.train.report import split_times


def run(folder: Path, steps: int, async_size: int, extra: list[str], batch: int) -> list[dict]:
    run_id = f"bench-async{async_size}-b{batch}"
    samples = batch * int(SETTINGS["--n-samples-per-prompt"])
    extra = ["--rollout-batch-size", str(batch), "--global-batch-size", str(samples), "--micro-batch-size",
             str(samples), *extra]  # fmt: skip
    args = [*train_args(folder, steps, async_size, run_id), "--eval-interval", str(10 * steps), *extra]
    result = subprocess.run([sys.executable, "-m", "services", "train", *args], capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"slipstream train failed:\n{result.stderr[-3000:]}")
    path = folder / run_id / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def row(name: str, steps: list[dict], skip: int) -> list[str]:
    kept = steps[skip:]
    splits = [split_times(s["metrics"]) for s in kept]
    step_s = statistics.mean(s["metrics"]["step_s"] for s in kept)
    parts = {k: statistics.mean(sp[k] for sp in splits) for k in splits[0]}
    wall = kept[-1]["time"] - steps[skip - 1]["time"] if skip else kept[-1]["time"] - kept[0]["time"]
    samples = sum(len(s["groups"]) for s in kept) * int(SETTINGS["--n-samples-per-prompt"])
    rewards = [s["metrics"]["reward"] for s in steps]
    cells = [name, f"{step_s * 1000:.0f}"]
    names = ("rollout", "reward", "train", "sync", "other")
    cells += [f"{parts[k] * 1000:.0f} ({parts[k] / step_s:.0%})" for k in names]
    cells += [f"{wall:.1f}", f"{samples / wall:.0f}", f"{statistics.mean(rewards[-20:]):.2f}"]
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out (start-up)")
    parser.add_argument(
        "--data-plane",
        action="store_true",
        help="every service on one Redis (--redis-url): the "
        "gateway writes the samples' arrays there and the trainer reads them (docs/buffer.md)",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[int(SETTINGS["--rollout-batch-size"])],
                        help="prompts per step, a run of each mode for each")  # fmt: skip
    args, extra = parser.parse_known_args()  # the rest goes to slipstream train (e.g. --rollout-num-gpus 1)
    header = ["mode", "step ms", "rollout", "reward", "train", "sync", "glue", "wall s", "samples/s", "reward@end"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        redis = EmbeddedRedis(Path(tmp) / "redis").start() if args.data_plane else None
        given = ["--redis-url", redis.url] if redis else []
        try:
            for batch in args.batch_sizes:
                for async_size in (0, 1):
                    steps = run(Path(tmp), args.steps, async_size, [*given, *extra], batch)
                    mode = "sync" if not async_size else f"async {async_size}"
                    rows.append(row(mode if len(args.batch_sizes) == 1 else f"{mode}, {batch} prompts", steps,
                                    args.skip))  # fmt: skip
        finally:
            if redis is not None:
                redis.stop()
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    print(f"\nsteps {args.skip}..{args.steps - 1} of each run, {platform.node()}")
    plane = " --data-plane" if args.data_plane else ""
    sizes = f" --batch-sizes {' '.join(map(str, args.batch_sizes))}" if len(args.batch_sizes) > 1 else ""
    print(f"python bench/e2e.py --steps {args.steps} --skip {args.skip}{plane}{sizes} {' '.join(extra)}".rstrip())


if __name__ == "__main__":
    main()
