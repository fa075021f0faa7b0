"""W&B's names and settings for `slipstream train --use-wandb` (the demo run that writes a W&B run and reads it back
is in tests/test_train.py)."""

import pytest

from services.common.config import ConfigError
from services.train import options
from services.train.wandb_log import eval_metrics, step_metrics


def test_a_steps_metrics_go_under_slimes_names():
    line = {"step": 7, "metrics": {"reward": 0.5, "loss": 0.1, "entropy": 2.0, "lr": 1e-6, "step_s": 3.0,
                                   "critic/value_loss": 0.2}}  # fmt: skip
    assert step_metrics(line) == {
        "rollout/raw_reward": 0.5, "train/loss": 0.1, "train/entropy_loss": 2.0, "train/lr-pg_0": 1e-6,
        "perf/step_time": 3.0, "train/critic/value_loss": 0.2, "rollout/step": 7, "train/step": 7,
    }  # fmt: skip


def test_an_evaluation_goes_under_slimes_names():
    result = {"step": 4, "results": {"aime": {"mean_reward": 0.25, "pass@2": 0.4, "truncated_ratio": 0.1}}}
    assert eval_metrics(result) == {"eval/step": 4, "eval/aime": 0.25, "eval/aime-pass@2": 0.4,
                                    "eval/aime-truncated_ratio": 0.1}  # fmt: skip


def test_wandb_settings_are_checked_before_anything_starts(monkeypatch):
    with pytest.raises(ConfigError, match="--wandb-mode"):
        options.route(["--use-wandb", "--wandb-mode", "offlne"])
    real = options.importlib.util.find_spec
    monkeypatch.setattr(options.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(ConfigError, match="--use-wandb needs the wandb package: pip install wandb"):
        options.route(["--use-wandb"])
