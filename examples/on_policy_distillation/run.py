"""On-policy distillation on the demo's task, on a CPU: a teacher is first trained on the task (teacher.py), then
the demo's untrained model learns from it alone (`--use-opd --opd-type sglang`, a teacher engine launched by the
gateway, every task reward replaced by 0 for training). The step's reward (the task's, reported) rises.

    python examples/on_policy_distillation/run.py [--output-dir runs] [--steps 40] [slipstream train flags]

The model and data (the demo's), the teacher and the run go to runs/model, runs/data, runs/teacher and runs/opd.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for `examples.…` and `services.…`

from examples.on_policy_distillation.teacher import train_teacher
from services.train.demo import prepare, train_args
from services.train.run import main as train_main

HERE = Path(__file__).resolve().parent


def args_for(folder: Path, steps: int) -> list[str]:
    """The `slipstream train` command line: the demo's, distilled from the teacher (trained first, once)."""
    model, _, _ = prepare(folder)
    teacher = folder / "teacher"
    if not (teacher / "config.json").exists():
        train_teacher(model, teacher)
    return [*train_args(folder, steps, run_id="opd"), "--lr", "3e-3", "--normalize-advantages",
            "--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "1.0", "--opd-teacher-hf-checkpoint", str(teacher),
            "--custom-reward-post-process-path", f"{HERE / 'distill.py'}:pure_distillation"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("runs"), help="the run goes to OUTPUT_DIR/opd")
    parser.add_argument("--steps", type=int, default=40)
    args, extra = parser.parse_known_args(argv)
    run = args.output_dir / "opd"
    print(f"on-policy distillation: a teacher first, then {args.steps} steps from it alone; the run: {run}", flush=True)
    command = args_for(args.output_dir, args.steps) + extra
    print("starting the services and the teacher's engine: ~30 s to step 0", flush=True)
    return train_main(command)


if __name__ == "__main__":
    sys.exit(main())
