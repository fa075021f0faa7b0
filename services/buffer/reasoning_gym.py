"""`slipstream reasoning-gym`: a reasoning-gym task's seeded problems as prompt data (JSONL) for the buffer, each row
with the problem's metadata, which the reward service's `reasoning_gym` type hands to the task's own checker.

A row is `{"prompt": [chat message], "label": answer, "metadata": {source_dataset, ..., question}}`: train with
`--input-key prompt --label-key label --apply-chat-template --rm-type reasoning_gym`. Train and held-out sets come
from different seeds.
"""

import argparse
import json
import sys
from pathlib import Path

INSTRUCTION = " Put only the final answer after 'Answer:'."


class TaskError(ValueError):
    """A task name or configuration reasoning-gym refuses; the message names the flag."""


def problems(task: str, config: dict, seed: int, size: int) -> list[dict]:
    """reasoning-gym's entries (`question`, `answer`, `metadata`) of `task` with `config`, from `seed`."""
    import reasoning_gym

    try:
        return list(reasoning_gym.create_dataset(task, seed=seed, size=size, **config))
    except (ValueError, AssertionError) as e:  # reasoning-gym's configs check themselves with assert
        if task not in reasoning_gym.factory.DATASETS:
            raise TaskError(f"--task {task!r} is not a reasoning-gym task; see reasoning_gym.factory.DATASETS") from e
        raise TaskError(f"--config {json.dumps(config)}: {e}") from e
    except TypeError as e:
        raise TaskError(f"--config {json.dumps(config)}: {e}; the task's config class names the fields") from e


def row(entry: dict, instruction: str = INSTRUCTION) -> dict:
    """A prompt-data row of one entry; the metadata keeps the question for checkers that read it."""
    metadata = json.loads(json.dumps(entry["metadata"], default=str))  # tuples as lists, anything else as text
    return {
        "prompt": [{"role": "user", "content": entry["question"] + instruction}],
        "label": str(entry["answer"]),
        "metadata": {**metadata, "question": entry["question"]},
    }


def write(path: Path, task: str, config: dict, seed: int, size: int, instruction: str = INSTRUCTION) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = (row(entry, instruction) for entry in problems(task, config, seed, size))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slipstream reasoning-gym", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSONL file to write")
    parser.add_argument("--task", required=True, help="a reasoning-gym task, e.g. basic_arithmetic, chain_sum")
    parser.add_argument("--config", default="{}", help="the task's settings as JSON, e.g. '{\"min_terms\": 2}'")
    parser.add_argument("--seed", type=int, default=1, help="the problems' seed (default 1; held-out sets: another)")
    parser.add_argument("--size", type=int, default=1000, help="how many problems (default 1000)")
    parser.add_argument("--instruction", default=INSTRUCTION, help="appended to each question (default: %(default)r)")
    args = parser.parse_args(argv)
    try:
        config = json.loads(args.config)
        if not isinstance(config, dict):
            raise TaskError(f"--config must be a JSON object, got {args.config}")
        write(args.out, args.task, config, args.seed, args.size, args.instruction)
    except json.JSONDecodeError as e:
        print(f"slipstream reasoning-gym: error: --config is not JSON ({e})", file=sys.stderr)
        return 2
    except TaskError as e:
        print(f"slipstream reasoning-gym: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {args.size} {args.task} problems (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
