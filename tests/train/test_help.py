"""What a new user reads: `slipstream train --help` is one screen of the flags a slime user sets first, by section;
`--help-all` lists every flag `slipstream train` accepts; each service's own `--help` is sectioned too; and every
hint to read a help names a command that runs."""

import os
import re
import subprocess
import sys

import pytest

from services.buffer.config import BufferConfig
from services.common.config import ConfigError, load_config
from services.common.sections import SECTIONS
from services.reward.config import RewardConfig
from services.rollout.config import RolloutConfig
from services.train import options
from services.train.help import FIRST, catalogue, full_help
from services.trainer.config import TrainerConfig

FIRST_NEEDED = ("--hf-checkpoint", "--prompt-data", "--lr", "--advantage-estimator", "--rollout-batch-size",
                "--n-samples-per-prompt", "--global-batch-size", "--rm-type", "--actor-num-gpus-per-node",
                "--rollout-num-gpus", "--eval-prompt-data", "--save", "--use-wandb")  # fmt: skip


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-m", "services", *args], capture_output=True, text=True, env=env)


def accepted_flags() -> set[str]:
    """Every flag `route()` takes: the launcher's and the services' settings (but those the launcher sets for each
    service it starts), and slime's flags it ignores, takes at one value only, or turns into recompute."""
    flags = set().union(*(options._flags(model) for model in (*options.SERVICES.values(), options.TrainOptions)))
    return flags | set(options.IGNORED) | set(options.NEUTRAL) | set(options.RECOMPUTE)


def sections_of(text: str) -> dict[str, str]:
    """The text under each section title (a line that starts in column 0 and ends with a colon)."""
    found, title = {}, None
    for line in text.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            title = line[:-1]
            found[title] = ""
        elif title is not None:
            found[title] += line + "\n"
    return found


def test_train_help_is_one_screen_of_the_flags_to_set_first():
    result = run_cli("train", "--help")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.rstrip().splitlines()
    assert len(lines) <= 60, result.stdout
    assert all(len(line) <= 100 for line in lines)
    shown = sections_of(result.stdout)
    used = [title for key, title in SECTIONS.items() if key != "other"]
    assert [title for title in shown if title in used] == used  # every section, in order
    for flag in FIRST_NEEDED:
        assert re.search(rf"^  {flag} ", result.stdout, re.MULTILINE), flag
    assert re.search(r"^  --lr +1e-06 +Peak learning rate$", result.stdout, re.MULTILINE)
    assert re.search(r"^  --advantage-estimator +grpo ", shown["algorithm"], re.MULTILINE)
    assert re.search(r"^  --n-samples-per-prompt +8 ", result.stdout, re.MULTILINE)  # the buffer is given 8 too
    footer = " ".join(lines[-3:])
    assert "--help-all shows every flag" in footer and "--check validates" in footer


def test_help_all_lists_every_flag_train_accepts_once():
    result = run_cli("train", "--help-all")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    shown = set(re.findall(r"(?<![\w-])--[a-z0-9][\w-]*", text))
    assert accepted_flags() - shown == set()
    described = re.findall(r"^  (--[\w-]+)", text, re.MULTILINE)  # the flags each listed in its own entry
    assert len(described) == len(set(described))
    assert "--sglang-<option> VALUE" in text
    flat = " ".join(text.split())
    for flag, reason in options.IGNORED.items():  # after its reason
        assert re.search(rf"{re.escape(reason)}: [^:]*{flag}(?![\w-])", flat), flag
    assert "--port" not in described and "--metrics-port" not in described  # the launcher sets them


def test_every_flag_is_in_a_section():
    """A new setting lands where services/common/sections.py's rules put it; none is left to 'other settings'."""
    entries = catalogue()
    assert [flag for flag, entry in entries.items() if entry.section == "other"] == []
    placed = {flag: entry.section for flag, entry in entries.items()}
    assert placed["--lr"] == placed["--weight-decay"] == "optimisation"  # the optimizer's group, not weight sync
    assert placed["--eps-clip"] == placed["--advantage-estimator"] == "algorithm"
    assert placed["--tensor-model-parallel-size"] == placed["--actor-num-gpus-per-node"] == "parallelism"
    assert placed["--redis-url"] == placed["--tls-cert-file"] == "deployment"
    assert placed["--eval-temperature"] == "evaluation" and placed["--rm-type"] == "reward"
    assert set(FIRST) <= set(entries)


def test_help_all_says_which_services_take_a_shared_flag():
    text = full_help(width=100)
    run_fact = text[text.index("  --n-samples-per-prompt") :].split("\n  --")[0]  # declared once: one default
    assert "[trainer, reward, buffer, rollout] (default: 8)" in " ".join(run_fact.split())
    redis = text[text.index("  --redis-url") :].split("\n  --")[0]
    assert "[trainer, buffer, rollout]" in " ".join(redis.split())


@pytest.mark.parametrize("model", [BufferConfig, RewardConfig, RolloutConfig, TrainerConfig])
def test_each_service_help_is_in_sections(model, capsys):
    with pytest.raises(SystemExit):
        load_config(model, ["--help"], prog="slipstream x")
    shown = sections_of(capsys.readouterr().out)
    groups = [title for title in shown if title in SECTIONS.values()]
    assert len(groups) >= 4, list(shown)
    assert "deployment (addresses, engines, Redis, security, timeouts)" in groups
    if model is TrainerConfig:
        assert "--eps-clip" in shown["algorithm"] and "--use-kl-loss" in shown["algorithm"]
        assert "--lr" in shown["optimisation"] and "--weight-decay" in shown["optimisation"]
        assert "--tensor-model-parallel-size" in shown["GPUs and parallelism"]
        assert "--hf-checkpoint" in shown["model and checkpoints"]


def test_a_bad_value_names_a_help_command_that_runs():
    """`slipstream train`'s trainer part is no command: the hint names `slipstream train --help-all`."""
    with pytest.raises(ConfigError) as error:
        options.parse(["--hf-checkpoint", "m", "--prompt-data", "p.jsonl", "--advantage-estimator", "grp"])
    command = re.search(r"see `slipstream ([^`]*)`", str(error.value)).group(1).split()
    assert command == ["train", "--help-all"]
    assert run_cli(*command).returncode == 0


def test_the_reward_types_are_named_whole():
    """--help's --rm-type row is not cut, and --help-all names every reward type the services take."""
    from services.reward.verifiers import RM_TYPES

    row = next(line for line in run_cli("train", "--help").stdout.splitlines() if line.startswith("  --rm-type "))
    assert "…" not in row
    everything = " ".join(run_cli("train", "--help-all").stdout.split())
    assert all(name in everything for name in RM_TYPES), [name for name in RM_TYPES if name not in everything]
