"""A tool-calling agent loop as a custom generate function (`--custom-generate-function-path
examples/multi_turn_tools/agent.py:generate`): the model answers, and when a turn ends in a
`<tool_call>…</tool_call>` the calculator runs in its sandbox and its result is appended as a tool message; up to
`--max-turns` assistant turns.

Token-in/token-out: each turn continues from the exact token ids so far, the model's tokens are kept as the engine
returned them (loss mask 1, with their rollout log-probs and weight-version spans) and only the tool messages are
tokenized here (loss mask 0, log-prob 0), so what the trainer sees is token for token what the engine generated.
"""

import asyncio
import json
import re
import sys
from pathlib import Path

from services.rollout.generate import extend_sample
from slipstream import samples as arrays
from slipstream.v1 import common_pb2

sys.path.insert(0, str(Path(__file__).parent))
from sandbox import calculate

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}]  # fmt: skip
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


async def generate(ctx, group: common_pb2.PromptGroup) -> list[common_pb2.Sample]:
    """The group's samples, one agent episode each. Partial samples from a pause are played again from the start."""
    return list(await asyncio.gather(*(episode(ctx, group) for _ in range(group.n_samples))))


async def episode(ctx, group: common_pb2.PromptGroup) -> common_pb2.Sample:
    tokenizer = ctx.tokenizer
    end_call = tokenizer.convert_tokens_to_ids("</tool_call>")
    budget = ctx.sampling_params["max_new_tokens"]  # for the whole response, tool messages included
    params = {**ctx.sampling_params, "stop_token_ids": [*ctx.sampling_params.get("stop_token_ids", []), end_call]}
    prompt = arrays.decode_tokens(group.prompt_tokens).tolist()
    sample = common_pb2.Sample(tokens=arrays.encode_tokens(prompt), prompt_length=len(prompt))
    for turn in range(ctx.config.max_turns):
        tokens = arrays.decode_tokens(sample.tokens).tolist()
        answer = await ctx.generate(tokens, {**params, "max_new_tokens": budget - sample.response_length})
        extend_sample(sample, answer, ctx.engines[-1])
        sample.num_turns += 1
        call = _TOOL_CALL.search(tokenizer.decode(answer["output_ids"], skip_special_tokens=False))
        if sample.status != common_pb2.SAMPLE_STATUS_COMPLETED or call is None or turn == ctx.config.max_turns - 1:
            break
        observation = tool_message(tokenizer, await calculate(_expression(call[1])))
        if sample.response_length + len(observation) >= budget:
            sample.status = common_pb2.SAMPLE_STATUS_TRUNCATED
            break
        _append_environment(sample, observation)
    return sample


def _expression(call: str) -> str:
    """The calculator's argument: Qwen's `{"name": …, "arguments": {"expression": …}}` or a bare expression."""
    try:
        return str(json.loads(call)["arguments"]["expression"])
    except (ValueError, KeyError, TypeError):
        return call.strip()


def tool_message(tokenizer, result: str) -> list[int]:
    """Token ids that close the assistant turn, carry the tool's result and open the next assistant turn, rendered
    by the model's own chat template."""
    closed = tokenizer.apply_chat_template([{"role": "assistant", "content": "\x00"}], tokenize=False)
    close = closed.split("\x00", 1)[1]
    tool = tokenizer.apply_chat_template(
        [{"role": "tool", "content": result}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(close + tool, add_special_tokens=False)


def _append_environment(sample: common_pb2.Sample, tokens: list[int]) -> None:
    sample.tokens += arrays.encode_tokens(tokens)
    sample.loss_mask += arrays.encode_mask([0] * len(tokens))
    sample.rollout_logprobs += arrays.encode_logprobs([0.0] * len(tokens))
    sample.response_length += len(tokens)
