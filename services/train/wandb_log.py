"""W&B for `slipstream train --use-wandb`: the metrics of every step (steps.jsonl) and of every evaluation, under
slime's names where slime has one (a slime user's dashboards keep working), each service's settings as the run
config, and each evaluation's results as a table. The launcher writes the run: it is where the trainer's steps, the
gateway's evaluations and every service's settings meet, and nothing else needs the `wandb` package or the key."""

import logging
import os
import secrets
from pathlib import Path

from services.common.config import printable
from services.common.errors import StartupError

log = logging.getLogger(__name__)

# Our metric → slime's (slime's trainer: train/<loss metric>, train/lr-pg_0; its timers: perf/<name>_time). The rest go
# under train/ with their own names.
SLIME_NAMES = {
    "reward": "rollout/raw_reward",
    "response_length": "rollout/response_lengths",
    "entropy": "train/entropy_loss",
    "lr": "train/lr-pg_0",
    "step_s": "perf/step_time",
    "train_s": "perf/train_time",
    "wait_s": "perf/train_wait_time",
    "sync_s": "perf/update_weights_time",
    "rollout_s": "perf/rollout_time",
    "tokens_per_s": "perf/actor_train_tok_per_s",
}
# slime's step metrics, and which one each prefix is plotted against (its define_metric calls).
STEP_METRICS = {"train/*": "train/step", "rollout/*": "rollout/step", "perf/*": "rollout/step", "eval/*": "eval/step"}


def metric_name(name: str) -> str:
    """W&B's name of one of our step metrics: slime's where it has one (a critic's as slime's critic role:
    train/critic-<name>), else train/<name>."""
    if name.startswith("critic/"):
        return "train/critic-" + metric_name(name.removeprefix("critic/")).removeprefix("train/")
    return SLIME_NAMES.get(name, f"train/{name}")


def step_metrics(line: dict) -> dict[str, float]:
    """One line of steps.jsonl as W&B metrics, with slime's step metrics: one line trains one rollout, so its
    rollout/step and train/step are the same."""
    step = line["step"]
    return {**{metric_name(k): v for k, v in line["metrics"].items()}, "rollout/step": step, "train/step": step}


def eval_metrics(result: dict) -> dict[str, float]:
    """One evaluation as slime logs it: eval/<set> (the mean reward), eval/<set>-<metric>, and eval/step."""
    out = {"eval/step": result["step"]}
    for name, metrics in result["results"].items():
        for metric, value in metrics.items():
            out[f"eval/{name}" if metric == "mean_reward" else f"eval/{name}-{metric}"] = value
    return out


def run_config(plan) -> dict:
    """Every service's settings and the launcher's (`train`), as W&B's run config, with no secret: no URL's password,
    no --wandb-key (a SecretStr, dumped as stars), no engine API key given as --sglang-api-key."""
    config = {name: printable(c) for name, c in plan.configs.items()}
    if "rollout" in config:
        engine = config["rollout"]["sglang_args"]
        config["rollout"]["sglang_args"] = [
            "***" if engine[i - 1 : i] == ["--api-key"] else "--api-key=***" if a.startswith("--api-key=") else a
            for i, a in enumerate(engine)
        ]
    return {**config, "train": printable(plan.options)}


class WandbRun:
    """The W&B run of a `slipstream train` run. Its id is kept in the run folder, so a resumed run (--load) goes on
    in the same W&B run, as slime's secondary processes join theirs (resume="allow"); --wandb-run-id names one."""

    def __init__(self, options, run_dir: Path, config: dict):
        import wandb

        self.wandb = wandb
        id_file = run_dir / "wandb-run-id"
        run_id = options.wandb_run_id or (id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4))
        folder = Path(options.wandb_dir or run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        # The key and the host as settings of this process: not wandb.login, which writes the key to ~/.netrc.
        settings = {"api_key": options.wandb_key.get_secret_value()} if options.wandb_key else {}
        if options.wandb_host:
            settings["base_url"] = options.wandb_host
        self.run = wandb.init(
            id=run_id,
            resume="allow",
            project=options.wandb_project,
            entity=options.wandb_team,
            group=options.wandb_group,
            name=options.wandb_group or run_dir.name,
            dir=str(folder),
            config=config,
            mode=options.wandb_mode,
            settings=wandb.Settings(silent=True, **settings),
        )
        id_file.write_text(self.run.id)
        for step in sorted(set(STEP_METRICS.values())):
            self.run.define_metric(step)
        for pattern, step in STEP_METRICS.items():
            self.run.define_metric(pattern, step_metric=step)
        log.info("W&B run %s (%s): %s", self.run.id, options.wandb_mode or "online", self.run.url or folder / "wandb")

    def step(self, line: dict) -> None:
        metrics = step_metrics(line)
        if line.get("samples"):  # --log-samples
            rows = [[line["step"], s["prompt"], s["response"], s["reward"]] for s in line["samples"]]
            metrics["train/samples"] = self.wandb.Table(columns=["step", "prompt", "response", "reward"], data=rows)
        self.run.log(metrics)

    def evaluation(self, result: dict) -> None:
        metrics = eval_metrics(result)
        names = sorted({k for m in result["results"].values() for k in m})
        rows = [[name, result["step"], *(m.get(k) for k in names)] for name, m in result["results"].items()]
        metrics["eval/results"] = self.wandb.Table(columns=["dataset", "step", *names], data=rows)
        self.run.log(metrics)

    def finish(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


def start(plan) -> WandbRun | None:
    """The run's W&B run with --use-wandb (before any service starts: a refused key stops nothing), else None."""
    options = plan.options
    if not options.use_wandb:
        return None
    # The launcher's own W&B service: one inherited from a parent process that uses W&B (WANDB_SERVICE: a pipeline, a
    # notebook, pytest) would take this run's records, and end with that process.
    os.environ.pop("WANDB_SERVICE", None)
    try:
        return WandbRun(options, plan.run_dir, run_config(plan))
    except ImportError as e:  # installed, but broken (options.py stops a run without the package)
        raise StartupError(f"--use-wandb: cannot import wandb ({e}); pip install wandb") from None
    except Exception as e:  # a missing or refused key, an unreachable server
        raise StartupError(f"--use-wandb: W&B did not start ({type(e).__name__}: {' '.join(str(e).split())}); pass "
                           "--wandb-key or set WANDB_API_KEY, check --wandb-host, or log to files with "
                           "--wandb-mode offline") from None  # fmt: skip
