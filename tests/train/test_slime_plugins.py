"""slime's extension points in `slipstream train` on the demo model: each example of examples/slime_plugins, written
as slime's docs show, runs unchanged in the real services (the trainer's hooks in the trainer, the rollout function on
the gateway's workers). A recorder module wraps each example to note every call (the example itself runs as written),
so each test sees that its plugin ran at every step and what came of it. Two runs: a custom loss replaces the policy
loss that a custom TIS lives in, so the TIS and the conversion get a run of their own."""

import json
from pathlib import Path

import pytest

from services.common.processes import PORT_RANGE_ENV, port_range_share
from services.train.demo import train_args
from tests.conftest import REPO, ServiceProcess
from tests.once import made_once

EXAMPLES = REPO / "examples" / "slime_plugins"
STEPS = 3
RECORDER = """
import json, os
from services.common.plugins import load_callable

def _call(hook, spec, *args, **kwargs):
    out = load_callable("{examples}/" + spec)(*args, **kwargs)
    with open(os.environ["PLUGIN_CALLS"], "a") as f:
        f.write(json.dumps({{"hook": hook, "pid": os.getpid()}}) + "\\n")
    return out

def reinforce_loss(args, batch, logits, sum_of_sample_mean):
    return _call("loss", "loss.py:reinforce_loss", args, batch, logits, sum_of_sample_mean)

def grpo_advantages(args, rollout_data):
    return _call("advantages", "advantages.py:grpo_advantages", args, rollout_data)

def icepop(args, **kwargs):
    return _call("tis", "tis.py:icepop", args, **kwargs)

def rank_rewards(args, samples):
    return _call("rewards", "rewards.py:rank_rewards", args, samples)

def convert_samples_to_train_data(args, samples):
    return _call("convert", "convert.py:convert_samples_to_train_data", args, samples)

def log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    return _call("rollout_log", "rollout_log.py:log_rollout_data", rollout_id, args, samples, rollout_extra_metrics,
                 rollout_time)

def generate_rollout(args, rollout_id, data_source, evaluation=False):
    return _call("rollout", "rollout.py:generate_rollout", args, rollout_id, data_source, evaluation=evaluation)
"""
RUNS = {
    "loss": ["--loss-type", "custom_loss", "--custom-loss-function-path", "{r}:reinforce_loss",
             "--custom-advantage-function-path", "{r}:grpo_advantages", "--custom-reward-post-process-path",
             "{r}:rank_rewards", "--custom-rollout-log-function-path", "{r}:log_rollout_data",
             "--rollout-function-path", "{r}:generate_rollout"],
    "tis": ["--use-tis", "--custom-tis-function-path", "{r}:icepop", "--custom-convert-samples-to-train-data-path",
            "{r}:convert_samples_to_train_data"],
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs, started together (each a whole `slipstream train`), finished before the first test reads them;
    made once for both test processes."""
    root = made_once(tmp_path_factory, "slime-plugin-runs", _start_and_finish)
    return {name: Run(root / name) for name in RUNS}


def _start_and_finish(root: Path) -> None:
    started = []
    for index, (name, flags) in enumerate(RUNS.items()):
        folder = root / name
        folder.mkdir()
        recorder = folder / "recorder.py"
        recorder.write_text(RECORDER.format(examples=EXAMPLES))
        args = [*train_args(folder, steps=STEPS), *(f.format(r=recorder) for f in flags)]
        env = {"PLUGIN_CALLS": str(folder / "calls.jsonl"), "ROLLOUT_LOG": str(folder / "rollout_log.jsonl")}
        if share := port_range_share(index, len(RUNS)):  # the two runs' launchers must not hand out the same port
            env[PORT_RANGE_ENV] = share
        started.append(ServiceProcess(["train", *args], folder / "train.log", cwd=folder, env=env))
    for proc in started:
        assert proc.wait(540) == 0, proc.log[-3000:]
        proc.stop()


class Run:
    def __init__(self, folder: Path):
        self.folder = folder
        self.steps = [json.loads(line) for line in (folder / "demo" / "steps.jsonl").read_text().splitlines()]
        self.calls = [json.loads(line) for line in (folder / "calls.jsonl").read_text().splitlines()]

    def count(self, hook: str) -> int:
        return sum(call["hook"] == hook for call in self.calls)

    def log(self, service: str) -> str:
        return (self.folder / "demo" / "logs" / f"{service}.log").read_text()


@pytest.mark.timeout(600)
def test_the_runs_train_every_step(runs):
    for run in runs.values():
        assert [s["step"] for s in run.steps] == list(range(STEPS))


@pytest.mark.timeout(600)
def test_a_custom_loss_replaces_the_policy_loss(runs):
    run = runs["loss"]
    assert run.count("loss") >= STEPS  # one call per micro-batch
    assert all(s["metrics"]["log_prob"] < 0 and "pg_clipfrac" not in s["metrics"] for s in run.steps)


@pytest.mark.timeout(600)
def test_custom_advantages_and_reward_post_processing_run_at_every_step(runs):
    run = runs["loss"]
    assert run.count("advantages") == STEPS and run.count("rewards") == STEPS


@pytest.mark.timeout(600)
def test_a_rollout_function_generates_every_step_on_the_gateway(runs):
    run = runs["loss"]
    assert run.count("rollout") >= STEPS
    assert "rollout function call 2: 32 group(s) returned" in run.log("rollout")
    trainer_pid = {c["pid"] for c in run.calls if c["hook"] == "loss"}
    assert not trainer_pid & {c["pid"] for c in run.calls if c["hook"] == "rollout"}  # in the gateway's process


@pytest.mark.timeout(600)
def test_a_rollout_log_function_gets_every_steps_samples(runs):
    run = runs["loss"]
    lines = [json.loads(line) for line in (run.folder / "rollout_log.jsonl").read_text().splitlines()]
    assert [line["rollout_id"] for line in lines] == list(range(STEPS))
    assert all(line["num_samples"] == 256 for line in lines)
    assert [line["mean_reward"] for line in lines] == pytest.approx([s["metrics"]["reward"] for s in run.steps])


@pytest.mark.timeout(600)
def test_a_custom_tis_and_a_custom_conversion_run_at_every_step(runs):
    run = runs["tis"]
    assert run.count("convert") == STEPS and run.count("tis") >= STEPS
    assert all("tis_abs" in s["metrics"] for s in run.steps)  # the example's own metric
