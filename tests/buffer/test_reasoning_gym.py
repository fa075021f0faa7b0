"""`slipstream reasoning-gym`: a task's seeded problems as prompt data, each row with what its checker needs; train and
held-out sets differ by seed; a bad task or setting is refused naming the flag."""

import json

import pytest

from services.buffer.reasoning_gym import main

pytest.importorskip("reasoning_gym")


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_problems_are_written_as_chat_prompts_with_their_answer_and_metadata(tmp_path):
    config = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'
    for seed in (1, 2):
        assert main([str(tmp_path / f"{seed}.jsonl"), "--task", "basic_arithmetic", "--config", config, "--seed",
                     str(seed), "--size", "20"]) == 0  # fmt: skip
    train, held_out = _rows(tmp_path / "1.jsonl"), _rows(tmp_path / "2.jsonl")
    assert len(train) == 20
    first = train[0]
    (message,) = first["prompt"]
    assert message["role"] == "user" and message["content"].endswith(" Put only the final answer after 'Answer:'.")
    assert first["metadata"]["source_dataset"] == "basic_arithmetic" and first["metadata"]["num_terms"] == 2
    assert message["content"].startswith(first["metadata"]["question"])
    assert int(first["label"]) == round(eval(first["metadata"]["expression"]))  # the answer as text
    assert [r["prompt"] for r in train] != [r["prompt"] for r in held_out]  # another seed, other problems
    assert _rows(tmp_path / "1.jsonl") == train  # the same seed, the same problems


def test_a_bad_task_or_setting_is_refused_naming_the_flag(tmp_path, capsys):
    out = str(tmp_path / "x.jsonl")
    assert main([out, "--task", "no_such_task"]) == 2
    assert "--task 'no_such_task' is not a reasoning-gym task" in capsys.readouterr().err
    assert main([out, "--task", "chain_sum", "--config", '{"min_terms": 5, "max_terms": 2}']) == 2
    assert "max_terms must be >= min_terms" in capsys.readouterr().err
    assert main([out, "--task", "chain_sum", "--config", '{"terms": 5}']) == 2
    assert "unexpected keyword argument 'terms'" in capsys.readouterr().err
    assert main([out, "--task", "chain_sum", "--config", "[1]"]) == 2
    assert "--config must be a JSON object" in capsys.readouterr().err
