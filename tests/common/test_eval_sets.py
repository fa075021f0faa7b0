"""slime's --eval-config files (services/common/eval_sets.py): defaults under each set, the buffer's and the gateway's
part of each set, the flags' route to them, and a mistake named by its set and key before anything starts."""

import asyncio
from pathlib import Path

import pytest

from services.buffer.config import BufferConfig
from services.buffer.prompts import eval_row_spec
from services.buffer.server import build_streams
from services.common import eval_sets
from services.common.config import ConfigError, load_config
from services.common.errors import StartupError
from services.common.plugins import PluginError
from services.reward.config import RewardConfig
from services.reward.server import build as build_reward
from services.reward.verifiers import BUILT_IN
from services.rollout.config import RolloutConfig
from services.rollout.workers import Rollout
from services.train.options import route

EXAMPLE = Path(__file__).parents[2] / "examples" / "eval_multi_task" / "eval_config.yaml"


def test_the_example_in_slimes_format_is_read_with_its_defaults():
    aime, gsm8k = eval_sets.load(EXAMPLE)
    assert (aime.name, aime.n_samples_per_eval_prompt, aime.metadata()) == ("aime", 16, {"rm_type": "deepscaler"})
    assert aime.sampling() == {"max_new_tokens": 16384, "top_p": 0.7}
    assert (gsm8k.input_key, gsm8k.label_key, gsm8k.path) == ("question", "answer", "data/gsm8k-test.parquet@[0:500]")
    assert gsm8k.sampling() == {"max_new_tokens": 16384, "top_p": 0.7, "temperature": 0}
    assert RewardConfig(eval_config=EXAMPLE).eval_rm_types() == {"aime": "deepscaler", "gsm8k": "gsm8k"}
    assert {"deepscaler", "gsm8k"} <= set(BUILT_IN)  # what the reward service checks at start


def test_the_three_configs_take_one_reading_of_the_file_and_a_changed_file_is_read_again(tmp_path, monkeypatch):
    path = _write(tmp_path, "datasets: [{name: a, path: a.jsonl, rm_type: exact, temperature: 0.5}]")
    reads = []
    monkeypatch.setattr(eval_sets, "load", lambda p, load=eval_sets.load: reads.append(p) or load(p))
    eval_sets._read.cache_clear()
    buffer = BufferConfig(eval_config=path, hf_checkpoint="model")
    rollout, reward = RolloutConfig(eval_config=path), RewardConfig(eval_config=path)
    assert buffer.eval_sets() is rollout.eval_sets() and len(reads) == 1
    assert rollout.eval_sets().get("a").sampling() == {"temperature": 0.5} and rollout.eval_sets().get("b") is None
    assert reward.eval_rm_types() == {"a": "exact"}
    path.write_text("datasets: [{name: b, path: b.jsonl}]  # changed, and longer")
    assert [s.name for s in buffer.eval_sets()] == ["b"] and len(reads) == 2
    with pytest.raises(ValueError, match="frozen"):
        buffer.eval_sets()[0].path = "other.jsonl"  # shared by the configs: read-only


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "eval.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("datasets:\n  - {name: a, path: a.jsonl, temprature: 0.5}\n", "set 'a': unknown key 'temprature'; did you"),
        ("datasets:\n  - {name: a}\n", "set 'a': path: Field required"),
        ("datasets:\n  - {path: a.jsonl}\n", "every entry of `datasets` needs a name"),
        ("datasets:\n  - {name: a, path: a.jsonl, app_service: x}\n", "set 'a': app_service is not supported here"),
        ("datasets:\n  - {name: a, path: a.jsonl, custom_rm_path: m:f}\n", "custom_rm_path is not supported here"),
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
    assert own.max_prompt_len is None  # as in slime, --rollout-max-prompt-len bounds training prompts only
    bounded = buffer.model_copy(update={"eval_max_prompt_len": 5, "rollout_max_prompt_len": 3})
    assert eval_row_spec(bounded, buffer.eval_sets()[0]).max_prompt_len == 5
    assert buffer.samples_per_eval_prompt() == {"own": 4, "flags": 2}
    rollout = Rollout(RolloutConfig(eval_config=path, eval_max_response_len=9, eval_min_new_tokens=1,
                                    rollout_max_response_len=11), pool=None, buffer=None, reward=None)  # fmt: skip
    assert rollout.sampling(evaluation=True, dataset="own")["max_new_tokens"] == 7
    assert rollout.sampling(evaluation=True, dataset="flags")["max_new_tokens"] == 9
    assert rollout.sampling(evaluation=True, dataset="flags")["min_new_tokens"] == 1
    assert rollout.sampling()["max_new_tokens"] == 11 and "min_new_tokens" not in rollout.sampling()
    assert "repetition_penalty" not in rollout.sampling(evaluation=True, dataset="own")


def test_eval_config_replaces_eval_prompt_data_as_in_slime(tmp_path, caplog):
    path = _write(tmp_path, "datasets:\n  - {name: a, path: a.jsonl}\n")
    buffer = BufferConfig(eval_config=path, eval_prompt_data=["b", "b.jsonl"], hf_checkpoint="m")
    assert [s.name for s in buffer.eval_sets()] == ["a"]
    assert "--eval-prompt-data is ignored" in caplog.text


def test_eval_flags_reach_every_service_that_takes_them_and_a_bad_file_stops_each(tmp_path):
    path = _write(tmp_path, "datasets:\n  - {name: aime, path: a.jsonl, temprature: 1}\n")
    routed = route(["--eval-config", str(path), "--eval-input-key", "q", "--eval-reward-key", "acc"])
    assert routed["buffer"][-4:] == ["--eval-config", str(path), "--eval-input-key", "q"]
    assert routed["rollout"] == ["--eval-config", str(path), "--eval-reward-key", "acc"]
    assert routed["reward"] == ["--eval-config", str(path)]
    for name, model in (("buffer", BufferConfig), ("rollout", RolloutConfig), ("reward", RewardConfig)):
        with pytest.raises(ConfigError, match="set 'aime': unknown key 'temprature'; did you mean 'temperature'"):
            load_config(model, routed[name], prog=name)


def test_a_set_with_an_unknown_reward_type_or_generate_function_stops_its_service(tmp_path):
    path = _write(tmp_path, "datasets:\n  - {name: aime, path: a.jsonl, rm_type: deepscalar}\n")
    with pytest.raises(StartupError, match="--eval-config set 'aime': rm_type 'deepscalar' is unknown"):
        asyncio.run(build_reward(RewardConfig(eval_config=path)))
    path = _write(tmp_path, "datasets:\n  - {name: aime, path: a.jsonl, custom_generate_function_path: nope:gen}\n")
    with pytest.raises(PluginError, match="--eval-config set 'aime': generate function: module 'nope' was not found"):
        Rollout(RolloutConfig(eval_config=path), pool=None, buffer=None, reward=None)


def test_a_row_without_an_eval_sets_key_names_the_eval_flag(tmp_path):
    (tmp_path / "qa.jsonl").write_text('{"q": "What is 1 + 1?"}\n')
    path = _write(tmp_path, f"datasets: {{qa: {{path: '{tmp_path / 'qa.jsonl'}'}}}}\n")  # slime's {name: settings}
    with pytest.raises(StartupError, match=r"pass --eval-input-key <key> \(or the set's own key in --eval-config\)"):
        build_streams(BufferConfig(eval_config=path, hf_checkpoint="m"), None)
