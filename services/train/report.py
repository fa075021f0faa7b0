"""What `slipstream train` shows: a progress bar with the current phase, one summary line per step, evaluation
results, and at the end a reward-curve PNG and a short summary."""

import json
from pathlib import Path

import rich.progress
from rich.console import Console
from rich.markup import escape

AGREEMENT_WARN = 0.1  # mean |trainer - engine| log-prob above which a run warns (bf16 runs measure about 0.01-0.03)
PHASES = {"waiting_batch": "rollout", "train": "train", "sync": "sync", "starting": "starting", "stopped": "stopping"}


class Progress:
    def __init__(self, total: int | None, first: int):
        self.console = Console(highlight=False, soft_wrap=True)
        self.bar = rich.progress.Progress(
            rich.progress.TextColumn("[bold]{task.description:<9}"),
            rich.progress.BarColumn(),
            rich.progress.MofNCompleteColumn(),
            rich.progress.TimeElapsedColumn(),
            rich.progress.TimeRemainingColumn(),
            console=self.console,
        )
        self.task = self.bar.add_task("starting", total=total, completed=first)
        self.last_step = first - 1
        self.errors_shown: set[str] = set()
        self.agreement_warned = False

    def __enter__(self) -> "Progress":
        self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()

    def phase(self, name: str) -> None:
        self.bar.update(self.task, description=PHASES.get(name, name))

    def step(self, line: dict) -> None:
        self.last_step = line["step"]
        self.bar.update(self.task, completed=line["step"] + 1)
        self.console.print(summary_line(line))
        difference = line["metrics"].get("train_rollout_logprob_abs_diff", 0.0)
        if difference > AGREEMENT_WARN and not self.agreement_warned:
            self.agreement_warned = True
            self.console.print(
                f"[yellow]the trainer's log-probs differ from the engines' by {difference:.3f} on average (over "
                f"{AGREEMENT_WARN}): the engines may run other weights, precision or chat template than the trainer"
            )
        for sample in line.get("samples", []):  # --log-samples: one line each, cut to the terminal
            text = " ".join(f"{sample['prompt']} → {sample['response']}".split())
            width = max(20, self.console.width - 14)
            cut = text if len(text) <= width else text[: width - 1] + "…"
            self.console.print(f"  [dim]{sample['reward']:7.3f}[/dim]  {escape(cut)}")
        for key, error in line.get("reward_errors", {}).items():  # the first of each kind, once
            if key not in self.errors_shown:
                self.errors_shown.add(key)
                self.console.print(f"[yellow]reward error {key} (first of its kind): {error['message']}")
                if error.get("traceback"):
                    self.console.print(error["traceback"], markup=False)

    def eval(self, result: dict) -> None:
        parts = [f"{name} {m['mean_reward']:.3f}" + _failed(m) for name, m in result["results"].items()]
        self.console.print(f"[cyan]eval @ step {result['step']}: " + ", ".join(parts))


def summary_line(line: dict) -> str:
    m = line["metrics"]
    text = f"step {line['step']:>4}  reward {m['reward']:.3f}  len {m.get('response_length', 0):.1f}"
    if m.get("reward_failed"):
        text += f"  reward failed {m['reward_failed']:.0%}"
    if "kl_loss" in m or "ppo_kl" in m:
        text += f"  kl {m.get('kl_loss', m.get('ppo_kl', 0.0)):.4f}"
    if "pg_clipfrac" in m:
        text += f"  clip {m['pg_clipfrac']:.3f}"
    if "train_rollout_logprob_abs_diff" in m:  # the trainer's log-probs against the engines' (mean |difference|)
        text += f"  logp diff {m['train_rollout_logprob_abs_diff']:.3f}"
    if "step_s" in m:
        split = split_times(m)
        text += f"  {m['step_s']:.2f}s (" + " ".join(f"{k} {v:.2f}" for k, v in split.items()) + ")"
        rate = m.get("samples_per_s", 0.0)
        text += f"  {rate:.0f} samples/s" if rate >= 10 else f"  {rate:.2g} samples/s"
    return text


def split_times(m: dict) -> dict[str, float]:
    """A step's time as rollout, reward, train, sync and the rest (the services' glue: RPC, Redis, serialisation).
    Rollout and reward count only while the trainer waits for them: with overlap they hide behind training."""
    parts = {
        "rollout": m.get("rollout_s", 0.0),
        "reward": m.get("reward_s", 0.0),
        "train": m.get("train_s", 0.0),
        "sync": m.get("sync_s", 0.0),
    }
    parts["other"] = max(0.0, m.get("step_s", 0.0) - sum(parts.values()))
    return parts


def finish(run_dir: Path, steps: list[dict], evals: list[dict], plan) -> None:
    console = Console(highlight=False)
    if not steps:
        console.print("no step was trained")
        return
    png = plot(run_dir / "reward.png", steps, evals, f"{run_dir.name}: mean reward per step")
    rewards = [s["metrics"]["reward"] for s in steps]
    tail = rewards[-20:]
    console.print(
        f"[bold]trained steps {steps[0]['step']}..{steps[-1]['step']}[/]: reward {rewards[0]:.3f} → "
        f"{rewards[-1]:.3f} (mean of the last {len(tail)}: {sum(tail) / len(tail):.3f})"
    )
    for result in evals[-1:]:
        parts = [f"{name} {m['mean_reward']:.3f}" + _failed(m) for name, m in result["results"].items()]
        console.print(f"eval at step {result['step']}: " + ", ".join(parts))
    trainer = plan.configs.get("trainer")
    if trainer is not None and trainer.save:
        console.print(f"checkpoints: {trainer.save}")
    console.print(f"reward curve: {png}\nTensorBoard: tensorboard --logdir {run_dir / 'tensorboard'}")
    console.print(f"logs: {run_dir / 'logs'}")
    (run_dir / "summary.json").write_text(
        json.dumps(
            {
                "steps": len(steps),
                "first_reward": rewards[0],
                "last_reward": rewards[-1],
                "mean_last_20": sum(tail) / len(tail),
                "reward_failed": reward_failed(steps),
                "eval": evals[-1] if evals else None,
            },
            indent=2,
        )
    )


def reward_failed(steps: list[dict]) -> dict:
    """The run's failed rewards: the mean of the steps' shares, and the count of each reward type and kind."""
    counts: dict[str, int] = {}
    for step in steps:
        for name, value in step["metrics"].items():
            if name.startswith("reward_errors/"):
                key = name.removeprefix("reward_errors/")
                counts[key] = counts.get(key, 0) + int(value)
    shares = [step["metrics"].get("reward_failed", 0.0) for step in steps]
    return {"share": sum(shares) / len(shares), "by_kind": dict(sorted(counts.items()))}


def _failed(metrics: dict) -> str:
    """How many of an evaluation's samples had no reward (scored 0), where any had none."""
    share, samples = metrics.get("reward_failed", 0.0), metrics.get("num_samples", 0)
    return f" ({share * samples:.0f} of {samples:.0f} rewards failed)" if share else ""


def plot(path: Path, steps: list[dict], evals: list[dict], title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s["step"] for s in steps], [s["metrics"]["reward"] for s in steps], label="train", alpha=0.8)
    names = sorted({name for e in evals for name in e["results"]})
    for name in names:
        points = [(e["step"], e["results"][name]["mean_reward"]) for e in evals if name in e["results"]]
        ax.plot(*zip(*points, strict=True), marker="o", label=f"eval: {name}")
    ax.set_title(title or "mean reward per step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: a short run's ticks too
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    if all(0 <= s["metrics"]["reward"] <= 1 for s in steps):
        ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
