"""Custom generate functions: the multi-turn tool example against a real engine (serving a scripted model that
calls the calculator), and a failing or inconsistent function, whose groups go back to the buffer."""

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from slipstream import samples
from slipstream.v1 import common_pb2, rollout_pb2
from tests.rollout.conftest import assert_groups_come_back, get_batch, wait_completed
from tests.rollout.scripted_model import write_scripted_model

EXAMPLE = Path(__file__).parents[2] / "examples" / "multi_turn_tools"
sys.path.insert(0, str(EXAMPLE))
from agent import tool_message  # noqa: E402
from sandbox import calculate, evaluate  # noqa: E402


@pytest.fixture(scope="module")
def calculator_model(tmp_path_factory):
    """Greedily, after "assistant\\n" this model writes <tool_call>12*7</tool_call>, turn after turn."""
    path = tmp_path_factory.mktemp("scripted")
    from services.train.tiny_checkpoint import write_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(write_tokenizer(path))
    prompt_end = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)[-1]
    call = tokenizer.encode("<tool_call>12*7</tool_call>", add_special_tokens=False)
    return write_scripted_model(path, [prompt_end, *call])


def test_multi_turn_samples_line_up_token_for_token_with_the_engine(make_system, calculator_model):
    system = make_system(
        num_engines=1, model=calculator_model, buffer={"apply_chat_template": True, "num_epoch": 1},
        custom_generate_function_path=f"{EXAMPLE}/agent.py:generate", hf_checkpoint=str(calculator_model),
        max_turns=3, rollout_temperature=0.0, rollout_max_response_len=64,
    )  # fmt: skip
    system.gateway.StartRollout(rollout_pb2.StartRolloutRequest(), timeout=10)
    wait_completed(system.buffer, 4)
    system.gateway.StopRollout(rollout_pb2.StopRolloutRequest(), timeout=30)
    tokenizer = AutoTokenizer.from_pretrained(calculator_model)
    environment = tool_message(tokenizer, "84")
    batch = get_batch(system.buffer, 0, 5)
    for sample in (s for g in batch.groups for s in g.samples):
        tokens = samples.decode_tokens(sample.tokens).tolist()
        response, mask = tokens[sample.prompt_length :], samples.decode_mask(sample.loss_mask).tolist()
        logprobs = samples.decode_logprobs(sample.rollout_logprobs).tolist()
        assert sample.num_turns == 3 and sample.status == common_pb2.SAMPLE_STATUS_COMPLETED
        turns = _segments(response, mask)
        assert [m for m, _ in turns] == [1, 0, 1, 0, 1]
        for m, ids in turns:  # model turns are the tool call, tool turns the calculator's answer
            expected = "<tool_call>12*7</tool_call>" if m else tokenizer.decode(environment, skip_special_tokens=False)
            assert tokenizer.decode(ids, skip_special_tokens=False) == expected
        forced = _teacher_forced_logprobs(system.engines[0], tokens, sample.prompt_length)
        for i, (m, lp) in enumerate(zip(mask, logprobs, strict=True)):
            if m:  # the engine's log-prob of the token it generated at this position, re-read in one prefill
                assert lp == pytest.approx(forced[i], abs=1e-4) and lp < -1e-3
            else:
                assert lp == 0.0
        assert [(v.version, v.start, v.end) for v in sample.weight_versions] == [
            ("default", start, end) for start, end in _model_spans(mask)
        ]


def _segments(tokens: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    out: list[tuple[int, list[int]]] = []
    for token, m in zip(tokens, mask, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(token)
        else:
            out.append((m, [token]))
    return out


def _model_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, position = [], 0
    for m, ids in _segments(list(range(len(mask))), mask):
        if m:
            spans.append((position, position + len(ids)))
        position += len(ids)
    return spans


def _teacher_forced_logprobs(url: str, tokens: list[int], prompt_length: int) -> list[float]:
    body = {
        "input_ids": tokens,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": prompt_length - 1,
    }  # fmt: skip  (SGLang gives no log-prob for the first token)
    meta = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
    by_position = {
        len(tokens) - len(meta["input_token_logprobs"]) + i: e[0] for i, e in enumerate(meta["input_token_logprobs"])
    }
    return [by_position[prompt_length + i] for i in range(len(tokens) - prompt_length)]


@pytest.mark.parametrize(
    ("body", "logged"),
    [
        ("raise RuntimeError('tool server down')", "the generate function failed"),
        ("s = common_pb2.Sample(tokens=group.prompt_tokens, prompt_length=1, response_length=0)\n"
         "    return [s] * group.n_samples", "tokens must start with the group's prompt tokens"),
    ],
)  # fmt: skip
def test_a_failing_generate_function_returns_groups_to_the_buffer(make_system, tmp_path, body, logged, caplog):
    path = tmp_path / "bad.py"
    path.write_text(f"from slipstream.v1 import common_pb2\n\nasync def generate(ctx, group):\n    {body}\n")
    system = make_system(num_engines=1, custom_generate_function_path=f"{path}:generate")
    assert_groups_come_back(system)
    assert any(logged in r.getMessage() and "train:e0:" in r.getMessage() for r in caplog.records)


def test_the_calculator_sandbox_allows_arithmetic_only():
    assert asyncio.run(calculate("12*7")) == "84"
    assert evaluate("(1 + 2) / 4") == 0.75
    for bad in ("__import__('os').system('true')", "open('/etc/passwd').read()", "(1).__class__", "x"):
        assert asyncio.run(calculate(bad)).startswith("error: ValueError")
    assert "exponent" in asyncio.run(calculate("9**9**9"))
    assert asyncio.run(calculate("1" * 300)).startswith("error: expression longer")
