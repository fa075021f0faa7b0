"""The table and the plot of `run.py`'s results: held-out accuracy at the start, at its best and at the end, seconds a
step, generated tokens a second, peak GPU memory, and the training seconds each run took to reach the peer's best.

    python examples/real_model/report.py runs/real_model [more folders] [--plot accuracy.png]
"""

import argparse
import json
import sys
from pathlib import Path


def load(folders: list[Path]) -> list[dict]:
    """The results, less any evaluation that did not cover the whole held-out set (a pass that a weight sync cut
    short, before that was fixed: it reported a few prompts), which is counted in `partial_evals`."""
    results = [json.loads(path.read_text()) for folder in folders for path in sorted(folder.glob("*.json"))]
    for r in results:
        whole = [e for e in r["evals"] if e.get("num_samples") in (None, r["settings"]["num_eval"])]
        r["partial_evals"], r["evals"] = len(r["evals"]) - len(whole), whole
    return results


def reached(result: dict, accuracy: float) -> float | None:
    """Training seconds until the first evaluation at or above `accuracy`."""
    return next((e["train_s"] for e in result["evals"] if e["accuracy"] >= accuracy - 1e-9), None)


def table(results: list[dict]) -> str:
    peers = {r["settings"]["task"]: r for r in results if r["runner"] == "trl"}
    lines = [
        "| run | task | steps | accuracy start → best (step) → end | s a step | generated tokens/s | peak GPU memory "
        "| training s to the peer's best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        evals = r["evals"]
        best = max(evals, key=lambda e: e["accuracy"])
        peer = peers.get(r["settings"]["task"])
        target = max(e["accuracy"] for e in peer["evals"]) if peer else None
        to_target = reached(r, target) if target is not None else None
        memory = " + ".join(f"{mib / 1024:.1f}" for _, mib in sorted(r["peak_gpu_mib"].items()))
        memory = f"{memory} GiB" if memory else "not recorded"
        partial = f" ({r['partial_evals']} partial evaluation left out)" if r["partial_evals"] else ""
        partial += f" (stopped: {r['error']})" if r.get("error") else ""
        lines.append(
            f"| {r['name']}{partial} | {r['settings']['task']} | {evals[-1]['step']} | {evals[0]['accuracy']:.1%} → "
            f"{best['accuracy']:.1%} ({best['step']}) → {evals[-1]['accuracy']:.1%} | {r['s_per_step']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {memory} | "
            + (f"{to_target:.0f} s (to {target:.1%})" if to_target is not None else "not reached" if peer else "—")
            + " |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["settings"]["task"] for r in results})
    figure, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for axis, task in zip(axes[0], tasks, strict=True):
        for r in (r for r in results if r["settings"]["task"] == task):
            evals = r["evals"]
            style = "--" if r["runner"] == "trl" else "-"
            steps, accuracies = [e["step"] for e in evals], [100 * e["accuracy"] for e in evals]
            axis.plot(steps, accuracies, style, marker="o", label=r["name"])
        axis.set(title=f"SmolLM2-135M-Instruct, {task}", xlabel="GRPO step", ylabel="held-out accuracy, greedy (%)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", type=Path, nargs="+")
    parser.add_argument("--plot", type=Path, help="write the accuracy curves to this PNG")
    args = parser.parse_args(argv)
    results = load(args.folders)
    if not results:
        print(f"no results (*.json) in {', '.join(map(str, args.folders))}", file=sys.stderr)
        return 1
    print(table(results))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
