"""Generating the samples of one prompt group: the built-in token-in/token-out path (with partial samples resumed
where an aborted request stopped), and the context and checks around a user's custom generate function.

A sample is built from SGLang's /generate answer: token ids in and out, rollout log-probs one per response token,
and the weight-version spans the engine reports, so nothing is re-tokenized between the engine and the trainer.
"""

import asyncio
import base64
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument
from services.rollout.engines import EnginePool
from slipstream import samples as arrays
from slipstream.v1 import common_pb2

FINISHED = (common_pb2.SAMPLE_STATUS_COMPLETED, common_pb2.SAMPLE_STATUS_TRUNCATED)
_STATUS = {
    "stop": common_pb2.SAMPLE_STATUS_COMPLETED,
    "length": common_pb2.SAMPLE_STATUS_TRUNCATED,
    "abort": common_pb2.SAMPLE_STATUS_ABORTED,
}


@dataclass
class GenerateContext:
    """What a generate function works with: the engine pool (through `generate`), the tokenizer, the reward service,
    the rollout's sampling parameters and the gateway's config (e.g. `config.max_turns`)."""

    pool: EnginePool
    sampling_params: dict
    config: object
    tokenizer: object = None
    reward: object = None  # RewardServiceStub, for functions that score inside their loop
    affinity: str | None = None
    engines: list[str] = field(default_factory=list)  # every engine that answered, in order

    async def generate(self, input_ids: list[int], sampling_params: dict | None = None, **extra) -> dict:
        """One /generate call (one sequence) with log-probs: SGLang's answer (`output_ids`, `meta_info`, `text`)."""
        payload = {"input_ids": input_ids, "sampling_params": sampling_params or self.sampling_params}
        if getattr(self.config, "use_rollout_routing_replay", False):
            payload["return_routed_experts"] = True
        answer, engine = await self.pool.generate({**payload, "return_logprob": True, **extra}, self.affinity)
        self.engines.append(engine.url)
        return answer


async def generate_group(ctx: GenerateContext, group: common_pb2.PromptGroup, resume: bool) -> list:
    """The group's samples: finished ones are kept, partial ones (aborted mid-response) continue where they stopped
    when `resume` (slime's --partial-rollout) or start over, and the missing ones are generated with one n>1 call."""
    kept = [s for s in group.samples if s.status in FINISHED]
    partial = [
        s for s in group.samples if resume and s.status == common_pb2.SAMPLE_STATUS_ABORTED and s.response_length
    ]
    need = group.n_samples - len(kept) - len(partial)
    prompt = arrays.decode_tokens(group.prompt_tokens).tolist()
    calls = [_continue(ctx, s) for s in partial]
    if need > 0:
        calls.append(_fresh(ctx, prompt, need))
    results = await asyncio.gather(*calls)
    fresh = results.pop() if need > 0 else []
    done = kept + results + fresh
    for index, sample in enumerate(done):
        sample.index, sample.sample_id = index, f"{group.group_id}/{index}"
    return done


def mask_offpolicy(group: common_pb2.PromptGroup) -> None:
    """--mask-offpolicy-in-partial-rollout: every response token the group's samples had before this round of
    generation, finished or not, gets loss mask 0 (older weights made it); only what is generated now is trained.
    slime masks the same tokens, before a custom generate function sees the samples as well."""
    for sample in group.samples:
        sample.loss_mask = arrays.encode_mask([0] * sample.response_length)


async def _fresh(ctx: GenerateContext, prompt: list[int], n: int) -> list:
    answer = await ctx.generate(prompt, {**ctx.sampling_params, "n": n})
    return [
        sample_from(prompt, output, ctx.engines[-1]) for output in (answer if isinstance(answer, list) else [answer])
    ]


async def _continue(ctx: GenerateContext, sample: common_pb2.Sample) -> common_pb2.Sample:
    """Resumes an aborted sample from its last token with the remaining token budget (max_new_tokens reduced)."""
    budget = ctx.sampling_params["max_new_tokens"] - sample.response_length
    if budget <= 0:
        sample.status = common_pb2.SAMPLE_STATUS_TRUNCATED
        return sample
    tokens = arrays.decode_tokens(sample.tokens).tolist()
    answer = await ctx.generate(tokens, {**ctx.sampling_params, "max_new_tokens": budget})
    return extend_sample(sample, answer, ctx.engines[-1])


def sample_from(prompt: list[int], output: dict, engine_url: str) -> common_pb2.Sample:
    """A Sample from one SGLang /generate answer: log-probs aligned with the output tokens, the model's spans."""
    sample = common_pb2.Sample(tokens=arrays.encode_tokens(prompt), prompt_length=len(prompt))
    return extend_sample(sample, output, engine_url)


def extend_sample(sample: common_pb2.Sample, output: dict, engine_url: str) -> common_pb2.Sample:
    """Appends an answer's tokens to `sample` as model tokens (loss mask 1), with their log-probs and spans."""
    meta = output["meta_info"]
    response = output["output_ids"]
    logprobs = [entry[0] for entry in meta.get("output_token_logprobs") or []]
    if len(logprobs) != len(response):
        raise InvalidArgument("output_token_logprobs", f"{len(logprobs)} log-probs for {len(response)} tokens")
    start = sample.response_length
    versions = meta.get("weight_versions") or [
        {"version": meta.get("weight_version", ""), "start": 0, "end": len(response)}
    ]
    for span in versions:
        sample.weight_versions.append(
            common_pb2.WeightVersionSpan(
                version=str(span["version"]), start=start + span["start"], end=start + span["end"]
            )
        )
    sample.tokens += arrays.encode_tokens(response)
    sample.loss_mask += arrays.encode_mask([1] * len(response))
    sample.rollout_logprobs += arrays.encode_logprobs(logprobs)
    sample.response_length += len(response)
    sample.response_text += output.get("text", "")
    if meta.get("routed_experts"):  # the engine's routing of the whole input and output: the sample's so far
        sample.routed_experts = base64.b64decode(meta["routed_experts"])
    finish = (meta.get("finish_reason") or {}).get("type", "abort")
    sample.status = _STATUS.get(finish, common_pb2.SAMPLE_STATUS_FAILED)
    sample.status_message = (meta.get("finish_reason") or {}).get("message") or ""
    sample.engine_url = engine_url
    return sample


def check_samples(group: common_pb2.PromptGroup, produced, what: str = "custom generate function") -> list:
    """A custom generate (or rollout) function's samples, checked before anything is stored: as many as the group
    needs, each starting with the group's prompt and carrying one loss-mask entry and one log-prob per response
    token."""
    if not isinstance(produced, list | tuple) or not all(isinstance(s, common_pb2.Sample) for s in produced):
        raise InvalidArgument(what, "must return a list of slipstream.v1.Sample")
    if len(produced) != group.n_samples:
        raise InvalidArgument(what, f"returned {len(produced)} samples for n={group.n_samples}")
    prompt = arrays.decode_tokens(group.prompt_tokens)
    for index, sample in enumerate(produced):
        where = f"sample {index}"
        tokens = arrays.decode_tokens(sample.tokens)
        if sample.prompt_length != len(prompt) or tokens[: len(prompt)].tolist() != prompt.tolist():
            raise InvalidArgument(where, "tokens must start with the group's prompt tokens (prompt_length of them)")
        if len(tokens) != sample.prompt_length + sample.response_length:
            raise InvalidArgument(where, f"has {len(tokens)} tokens, prompt_length + response_length differ")
        for name, size in (
            ("loss_mask", len(sample.loss_mask)),
            ("rollout_logprobs", len(sample.rollout_logprobs) // 4),
        ):
            if size != sample.response_length:
                raise InvalidArgument(where, f"{name} has {size} entries for {sample.response_length} response tokens")
        sample.index, sample.sample_id = index, f"{group.group_id}/{index}"
    return list(produced)
