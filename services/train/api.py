"""`slipstream train` from Python (a notebook, a script): the same settings as keyword arguments, in the flags'
names with underscores; the same services started as processes; the same clean stop (an interrupt, such as a
notebook's ■, stops every service); the run's summary back.

    from services.train.api import train

    summary = train(hf_checkpoint="runs/model", prompt_data="runs/data/train.jsonl", num_rollout=20,
                    rollout_batch_size=32, n_samples_per_prompt=8, global_batch_size=256, apply_chat_template=True)

A value becomes its flag's argument: True a switch (`apply_chat_template=True` → `--apply-chat-template`), False its
`--no-` form, a list several arguments (`eval_prompt_data=["held_out", "eval.jsonl"]`), a dict JSON, None nothing.
"""

import json
import os
from pathlib import Path

from services.common.config import ConfigError
from services.train.options import parse
from services.train.run import execute


class TrainFailed(RuntimeError):
    """The run stopped on an error; its last words were printed, and its logs stay in the run's folder."""


def argv_of(settings: dict) -> list[str]:
    """The `slipstream train` command line of keyword settings."""
    argv = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list | tuple):
            argv += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, os.fspath(value) if isinstance(value, Path) else str(value)]
    return argv


def train(**settings) -> dict:
    """Runs `slipstream train` with `settings` and returns its summary (the run folder's summary.json, with the run
    folder under "run_dir"). Raises ValueError for a setting it refuses (the CLI's sentence), TrainFailed when the run
    stops on an error, KeyboardInterrupt when it was interrupted; every service is stopped in each case."""
    try:
        plan = parse(argv_of(settings))
    except ConfigError as e:
        raise ValueError(str(e)) from None
    code = execute(plan)
    if code == 130:
        raise KeyboardInterrupt
    if code:
        raise TrainFailed(f"the run stopped with code {code} (its last words are above); logs: {plan.run_dir / 'logs'}")
    return {**json.loads((plan.run_dir / "summary.json").read_text()), "run_dir": str(plan.run_dir)}
