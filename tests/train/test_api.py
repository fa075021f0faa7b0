"""The Python API (services/train/api.py): keyword settings become the command line; the notebook example runs as
a notebook's cells would, in one interpreter, trains the demo's model and leaves no process behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.train.api import argv_of, train
from tests.test_train import processes_of

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "examples" / "notebook" / "train.ipynb"


def test_keyword_settings_become_the_command_line():
    settings = dict(hf_checkpoint=Path("m"), apply_chat_template=True, offload_rollout=False, lr=3e-3, save=None,
                    eval_prompt_data=["held_out", Path("e.jsonl")], apply_chat_template_kwargs={"x": 1})  # fmt: skip
    assert argv_of(settings) == ["--hf-checkpoint", "m", "--apply-chat-template", "--no-offload-rollout", "--lr",
                                 "0.003", "--eval-prompt-data", "held_out", "e.jsonl",
                                 "--apply-chat-template-kwargs", '{"x": 1}']  # fmt: skip


def test_a_refused_setting_raises_the_command_lines_sentence(tmp_path):
    with pytest.raises(ValueError, match=r"--lr: Input should be greater than 0"):
        train(hf_checkpoint=tmp_path, prompt_data=tmp_path / "p.jsonl", lr=-1e-3)
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(600)
def test_the_notebook_example_trains_the_demo_and_leaves_nothing_behind(tmp_path):
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = "\n\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=540)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "notebook"
    assert f"the run's folder: {run_dir.relative_to(tmp_path)}" in result.stdout, result.stdout[-2000:]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 30 and len(steps[-1]["samples"]) == 2
    assert processes_of(run_dir) == []
