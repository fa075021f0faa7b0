"""slime's --eval-config files (services/common/eval_sets.py): defaults under each set, the buffer's and the gateway's
part of each set, and a file with a mistake named by its set and key."""

from pathlib import Path

import pytest

from services.buffer.config import BufferConfig
from services.buffer.server import eval_row_spec
from services.common import eval_sets
from services.rollout.config import RolloutConfig
from services.rollout.workers import Rollout

EXAMPLE = Path(__file__).parents[2] / "examples" / "eval_multi_task" / "eval_config.yaml"


def test_the_example_in_slimes_format_is_read_with_its_defaults():
    aime, gsm8k = eval_sets.load(EXAMPLE)
    assert (aime.name, aime.n_samples_per_eval_prompt, aime.metadata()) == ("aime", 16, {"rm_type": "deepscaler"})
    assert aime.sampling() == {"max_new_tokens": 16384, "top_p": 0.7}
    assert (gsm8k.input_key, gsm8k.label_key, gsm8k.path) == ("question", "answer", "data/gsm8k-test.parquet@[0:500]")
    assert gsm8k.sampling() == {"max_new_tokens": 16384, "top_p": 0.7, "temperature": 0}


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "eval.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("datasets:\n  - {name: a, path: a.jsonl, temprature: 0.5}\n", "set 'a': unknown key 'temprature'"),
        ("datasets:\n  - {name: a}\n", "set 'a': path: Field required"),
        ("datasets:\n  - {name: a, path: a.jsonl, app_service: x}\n", "app_service is not supported here"),
        ("defaults: {top_q: 1}\ndatasets:\n  - {name: a, path: a.jsonl}\n", "defaults: unknown key 'top_q'"),
        ("datasets:\n  - {name: a, path: a.jsonl}\n  - {name: a, path: b.jsonl}\n", "must be unique"),
        ("datasets:\n  - {name: a, path: a.jsonl, top_p: 2}\n", "set 'a': top_p: Input should be less than"),
        ("eval: {}\n", "`datasets` must list at least one set"),
    ],
)
def test_a_mistake_in_the_file_is_named(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        eval_sets.load(_write(tmp_path, text))


def test_each_set_takes_its_own_then_the_eval_flags_then_the_training_settings(tmp_path):
    own = "{name: own, path: a.jsonl, input_key: question, rm_type: f1, n_samples_per_eval_prompt: 4, "
    own += "max_response_len: 7}"
    path = _write(tmp_path, f"eval:\n  datasets:\n    - {own}\n    - {{name: flags, path: b.jsonl}}\n")
    buffer = BufferConfig(eval_config=path, hf_checkpoint="m", input_key="prompt", label_key="label",
                          eval_label_key="answer", n_samples_per_eval_prompt=2)  # fmt: skip
    own, flags = (eval_row_spec(buffer, s) for s in buffer.eval_sets())
    assert (own.input_key, own.label_key, own.metadata) == ("question", "answer", {"rm_type": "f1"})
    assert (flags.input_key, flags.label_key, flags.metadata) == ("prompt", "answer", {})
    assert buffer.samples_per_eval_prompt() == {"own": 4, "flags": 2}
    rollout = Rollout(RolloutConfig(eval_config=path, eval_max_response_len=9, eval_min_new_tokens=1,
                                    rollout_max_response_len=11), pool=None, buffer=None, reward=None)  # fmt: skip
    assert rollout.sampling(evaluation=True, dataset="own")["max_new_tokens"] == 7
    assert rollout.sampling(evaluation=True, dataset="flags")["max_new_tokens"] == 9
    assert rollout.sampling(evaluation=True, dataset="flags")["min_new_tokens"] == 1
    assert rollout.sampling()["max_new_tokens"] == 11 and "min_new_tokens" not in rollout.sampling()


def test_eval_config_and_eval_prompt_data_exclude_each_other(tmp_path):
    path = _write(tmp_path, "datasets:\n  - {name: a, path: a.jsonl}\n")
    with pytest.raises(ValueError, match="drop --eval-prompt-data"):
        BufferConfig(eval_config=path, eval_prompt_data=["b", "b.jsonl"], hf_checkpoint="m")
