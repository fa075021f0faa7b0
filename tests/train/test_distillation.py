"""On-policy distillation end to end (examples/on_policy_distillation): a student learns the demo's task from a
teacher trained on it, with every training reward 0 (slime's pure distillation), the teacher served by an engine the
gateway launches; and with the teacher loaded in a trainer of two tensor-parallel CPU processes."""

import json
from pathlib import Path

import pytest

from examples.on_policy_distillation.run import args_for
from services.trainer.config import TrainerConfig
from tests.once import made_once


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line)["metrics"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


@pytest.fixture
def teacher(tmp_path_factory, tmp_path) -> Path:
    """The example's teacher in the test's folder, trained once for both test processes (a minute or two)."""
    shared = made_once(tmp_path_factory, "opd-teacher", lambda made: args_for(made, steps=1))
    (tmp_path / "teacher").symlink_to(shared / "teacher")
    return tmp_path / "teacher"


@pytest.mark.slow  # 40 steps; `make test` distils 3 steps from a Megatron teacher (below), `make test-slow` this too
@pytest.mark.timeout(600)
def test_the_student_learns_the_task_from_the_teachers_signal_alone(service_process, tmp_path, teacher):
    run = service_process("train", *args_for(tmp_path, steps=40))
    assert run.wait(480) == 0, run.log[-3000:]
    steps = _metrics(tmp_path / "opd")
    rewards, kl = [s["reward"] for s in steps], [s["opd_reverse_kl"] for s in steps]
    assert len(steps) == 40 and _mean(rewards[:8]) <= 0.1, rewards
    assert _mean(rewards[-8:]) >= _mean(rewards[:8]) + 0.1, rewards  # the task's reward, never trained on
    assert _mean(kl[-8:]) < _mean(kl[:8]), kl


@pytest.mark.timeout(600)
def test_a_megatron_teacher_trains_under_tensor_parallelism(service_process, tmp_path, teacher):
    args = [a for a in args_for(tmp_path, steps=3)]
    at = args.index("--opd-type")
    args[at + 1] = "megatron"
    teacher = args.pop(args.index("--opd-teacher-hf-checkpoint") + 1)
    args.remove("--opd-teacher-hf-checkpoint")
    args += ["--opd-teacher-load", teacher, "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"]
    run = service_process("train", *args)
    assert run.wait(480) == 0, run.log[-3000:]
    kl = [s["opd_reverse_kl"] for s in _metrics(tmp_path / "opd")]
    assert len(kl) == 3 and all(8 < k < 20 for k in kl), kl  # the untrained student against a sure teacher
    # A --save folder as the teacher (each rank's shard of its last step, 3): the student after three steps, close to
    # the student from the start, unlike the sure teacher
    at = args.index("--opd-teacher-load")
    args[at + 1] = str(tmp_path / "opd" / "checkpoints")
    args += ["--opd-teacher-ckpt-step", "3", "--run-id", "again", "--save", str(tmp_path / "again" / "checkpoints")]
    run = service_process("train", *args)
    assert run.wait(480) == 0, run.log[-3000:]
    kl = [s["opd_reverse_kl"] for s in _metrics(tmp_path / "again")]
    assert len(kl) == 3 and all(abs(k) < 1 for k in kl), kl


def test_the_distillation_settings_are_checked_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match="--use-opd needs --opd-type"):
        TrainerConfig(use_opd=True)
    with pytest.raises(ValueError, match="add --opd-teacher-load"):
        TrainerConfig(use_opd=True, opd_type="megatron")
    with pytest.raises(ValueError, match="no such folder"):
        TrainerConfig(use_opd=True, opd_type="megatron", opd_teacher_load=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="--opd-teacher-load is the teacher of"):
        TrainerConfig(use_opd=True, opd_type="sglang", opd_teacher_load=str(tmp_path))
