"""W&B for `slipstream train --use-wandb`: the metrics of every step (steps.jsonl) and of every evaluation, under
slime's names where slime has one (a slime user's dashboards keep working), each service's settings as the run
config, and each evaluation's results as a table. The launcher writes the run: it is where the trainer's steps, the
gateway's evaluations and every service's settings meet, and nothing else needs the `wandb` package or the key."""

import logging
import os
import secrets
from pathlib import Path

from services.common.config import ConfigError, printable
from services.common.errors import StartupError

log = logging.getLogger(__name__)

# Our metric → slime's. The rest go under train/ (the trainer's) with their own names.
SLIME_NAMES = {
    "reward": "rollout/raw_reward",
    "response_length": "rollout/response_lengths",
    "loss": "train/loss",
    "pg_loss": "train/pg_loss",
    "entropy": "train/entropy_loss",
    "pg_clipfrac": "train/pg_clipfrac",
    "ppo_kl": "train/ppo_kl",
    "kl_loss": "train/kl_loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr-pg_0",
    "step_s": "perf/step_time",
    "train_s": "perf/train_time",
    "wait_s": "perf/train_wait_time",
    "sync_s": "perf/update_weights_time",
    "rollout_s": "perf/rollout_time",
    "reward_s": "perf/reward_time",
    "tokens_per_s": "perf/actor_train_tok_per_s",
    "samples_per_s": "perf/samples_per_s",
    "mfu": "perf/mfu",
}


def step_metrics(line: dict) -> dict[str, float]:
    """One line of steps.jsonl as W&B metrics, with slime's step metrics (rollout/step, train/step)."""
    step = line["step"]
    out = {SLIME_NAMES.get(name, f"train/{name}"): value for name, value in line["metrics"].items()}
    return {**out, "rollout/step": step, "train/step": step}


def eval_metrics(result: dict) -> dict[str, float]:
    """One evaluation as slime logs it: eval/<set> (the mean reward), eval/<set>-<metric>, and eval/step."""
    out = {"eval/step": result["step"]}
    for name, metrics in result["results"].items():
        for metric, value in metrics.items():
            out[f"eval/{name}" if metric == "mean_reward" else f"eval/{name}-{metric}"] = value
    return out


class WandbRun:
    """The W&B run of a `slipstream train` run; its id is kept in the run folder, so a resumed run (--load) goes on
    in the same W&B run (or the one --wandb-run-id names)."""

    def __init__(self, options, run_dir: Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise ConfigError("--use-wandb needs the wandb package: pip install wandb") from None
        self.wandb = wandb
        id_file = run_dir / "wandb-run-id"
        run_id = options.wandb_run_id or (id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4))
        if options.wandb_key and options.wandb_mode != "offline":
            wandb.login(key=options.wandb_key, host=options.wandb_host, verify=False)
        folder = Path(options.wandb_dir or run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            id=run_id, resume="allow", project=options.wandb_project, entity=options.wandb_team,
            group=options.wandb_group, name=options.wandb_group or options.run_id, dir=str(folder), config=config,
            mode=options.wandb_mode, settings=wandb.Settings(silent=True, x_disable_stats=True),
        )  # fmt: skip
        id_file.write_text(self.run.id)
        for prefix, step in (("train", "train/step"), ("rollout", "rollout/step"), ("perf", "rollout/step"),
                             ("eval", "eval/step")):  # fmt: skip
            if prefix != "perf":
                self.run.define_metric(step)
            self.run.define_metric(f"{prefix}/*", step_metric=step)
        log.info("W&B run %s (%s) in %s", self.run.id, options.wandb_mode or "online", folder)

    def step(self, line: dict) -> None:
        self.run.log(step_metrics(line))

    def evaluation(self, result: dict) -> None:
        metrics = eval_metrics(result)
        names = sorted({k for m in result["results"].values() for k in m})
        rows = [[name, result["step"], *(m.get(k) for k in names)] for name, m in result["results"].items()]
        metrics["eval/results"] = self.wandb.Table(columns=["dataset", "step", *names], data=rows)
        self.run.log(metrics)

    def finish(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


def run_config(plan) -> dict:
    """Every service's settings and the launcher's, as W&B's run config (URL passwords and the W&B key left out)."""
    config = {name: printable(c) for name, c in plan.configs.items()}
    return {**config, "train": printable(plan.options, exclude={"wandb_key"})}


def start(plan) -> "WandbRun | None":
    options = plan.options
    if not options.use_wandb:
        return None
    if options.wandb_mode:
        os.environ["WANDB_MODE"] = options.wandb_mode
    try:
        return WandbRun(options, options.run_dir, run_config(plan))
    except Exception as e:  # a refused key, an unreachable server: say so before anything starts
        raise StartupError(f"--use-wandb: W&B did not start: {type(e).__name__}: {e}") from None
