"""W&B's names and settings for `slipstream train --use-wandb` (the demo run that writes a W&B run and reads it back
is in tests/test_train.py, with the resumed run that goes on in the same W&B run)."""

import json

import pytest

from services.common.config import ConfigError, load_config
from services.common.errors import StartupError
from services.train import options, runfile, wandb_log
from services.train.wandb_log import eval_metrics, run_config, step_metrics


def test_a_steps_metrics_go_under_slimes_names_and_the_rest_under_train():
    line = {"step": 7, "metrics": {"reward": 0.5, "response_length": 12.0, "loss": 0.1, "pg_clipfrac": 0.2,
                                   "entropy": 2.0, "lr": 1e-6, "step_s": 3.0, "sync_s": 0.5, "tokens_per_s": 900.0,
                                   "mfu": 0.3, "critic/value_loss": 0.2, "critic/lr": 1e-5}}  # fmt: skip
    assert step_metrics(line) == {
        "rollout/raw_reward": 0.5, "rollout/response_lengths": 12.0, "train/loss": 0.1, "train/pg_clipfrac": 0.2,
        "train/entropy_loss": 2.0, "train/lr-pg_0": 1e-6, "perf/step_time": 3.0, "perf/update_weights_time": 0.5,
        "perf/actor_train_tok_per_s": 900.0, "train/mfu": 0.3, "train/critic-value_loss": 0.2,
        "train/critic-lr-pg_0": 1e-5, "rollout/step": 7, "train/step": 7,
    }  # fmt: skip


def test_an_evaluation_goes_under_slimes_names():
    result = {"step": 4, "results": {"aime": {"mean_reward": 0.25, "pass@2": 0.4, "truncated_ratio": 0.1}}}
    assert eval_metrics(result) == {"eval/step": 4, "eval/aime": 0.25, "eval/aime-pass@2": 0.4,
                                    "eval/aime-truncated_ratio": 0.1}  # fmt: skip


def plan_of(argv: list[str]) -> options.Plan:
    """What `slipstream train` plans, without the checks of files and models that `options.parse` adds."""
    routed = options.route(argv)
    plan = options.Plan(load_config(options.TrainOptions, routed.pop("train"), "slipstream train"), argv=routed)
    plan.configs = {name: load_config(model, routed[name], name) for name, model in options.SERVICES.items()}
    return plan


def test_the_run_config_has_every_setting_and_no_secret_and_the_key_reaches_no_service():
    argv = ["--use-wandb", "--wandb-key", "KEY-1", "--sglang-api-key", "KEY-2", "--redis-url",
            "redis://:KEY-3@redis:6379", "--lr", "2e-5"]  # fmt: skip
    plan = plan_of(argv)
    assert not any("KEY-1" in arg for args in plan.argv.values() for arg in args)  # no service's command line
    assert "KEY-1" not in repr(plan.options) and plan.options.wandb_key.get_secret_value() == "KEY-1"
    config = run_config(plan)
    assert set(config) == {"buffer", "reward", "rollout", "trainer", "train"} and config["trainer"]["lr"] == 2e-5
    assert "KEY" not in json.dumps(config), json.dumps(config)


def test_wandb_settings_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match="--wandb-mode: Input should be 'online', 'offline' or 'disabled'"):
        options.route(["--use-wandb", "--wandb-mode", "offlne"])
    with pytest.raises(ConfigError, match="unknown option --wandb-projet; did you mean --wandb-project"):
        options.route(["--use-wandb", "--wandb-projet", "x"])


def test_without_the_wandb_package_the_launcher_says_to_install_it_and_the_services_need_none(monkeypatch, tmp_path):
    real = options.importlib.util.find_spec
    monkeypatch.setattr(options.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ConfigError, match=r"^--use-wandb needs the wandb package: pip install wandb$"):
        options.parse(["--use-wandb", "--wandb-mode", "offline"])
    (tmp_path / "run.flags").write_text("--use-wandb --wandb-project x --lr 2e-5\n")  # a deployment's run file
    assert runfile.expand("trainer", [f"@{tmp_path / 'run.flags'}"]) == ["--lr", "2e-5"]


def test_a_resumed_run_goes_on_in_the_same_wandb_run_and_wandb_run_id_names_one(tmp_path):
    argv = ["--use-wandb", "--wandb-mode", "offline", "--output-dir", str(tmp_path), "--run-id", "r"]
    ids = []
    for extra in ([], [], ["--wandb-run-id", "chosen"]):
        run = wandb_log.start(plan_of(argv + extra))
        run.step({"step": len(ids), "metrics": {"reward": 0.5}})
        run.finish()
        ids.append(run.run.id)
    assert ids[0] == ids[1] != ids[2] == "chosen" and (tmp_path / "r" / "wandb-run-id").read_text() == "chosen"


def test_an_online_run_without_a_key_stops_before_any_service_starts_saying_what_to_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(StartupError, match=r"--use-wandb: W&B did not start .*; pass --wandb-key or set WANDB_API_KEY"):
        wandb_log.start(plan_of(["--use-wandb", "--wandb-mode", "online", "--output-dir", str(tmp_path)]))
