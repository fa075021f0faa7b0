"""On-policy distillation with --opd-type sglang: the teacher's log-prob of every response token, fetched as each
training group finishes and stored with its samples (`Sample.teacher_logprobs`), so that they reach the trainer with
the batch. The teacher engines are a pool of their own (health checks, eviction, re-admission, retries on another
engine), asked as slime asks them: the whole sequence with `max_new_tokens` 0, `return_logprob` and
`logprob_start_len` 0, the response's share of `input_token_logprobs` kept. A group whose log-probs cannot be had goes
back to the buffer: no sample is trained without them."""

import logging

from services.common.errors import Unavailable
from services.rollout.config import RolloutConfig
from services.rollout.engines import EnginePool
from slipstream import samples
from slipstream.v1 import common_pb2

log = logging.getLogger(__name__)


class Teacher:
    def __init__(self, config: RolloutConfig):
        self.config = config
        self.pool = EnginePool(config)

    async def register(self, urls: list[str]) -> None:
        for url in urls:  # one that is down now is kept evicted and admitted once it answers
            await self.pool.register(url)

    async def annotate(self, group: common_pb2.PromptGroup) -> None:
        """Sets each generated sample's teacher_logprobs, in one /generate call for the group (retried on another
        teacher engine when one fails); raises Unavailable when none answers."""
        untrained = (common_pb2.SAMPLE_STATUS_FAILED, common_pb2.SAMPLE_STATUS_ABORTED)
        asked = [s for s in group.samples if s.status not in untrained and s.response_length]
        if not asked:
            return
        payload = {
            "input_ids": [samples.decode_tokens(s.tokens).tolist() for s in asked],
            "sampling_params": {
                "temperature": self.config.rollout_temperature,
                "max_new_tokens": 0,
                "skip_special_tokens": False,
            },
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        answer, engine = await self.pool.generate(payload, affinity=group.group_id)
        outputs = answer if isinstance(answer, list) else [answer]
        if len(outputs) != len(asked):
            raise Unavailable(f"teacher {engine.url} answered {len(outputs)} outputs for {len(asked)} sequences")
        for sample, output in zip(asked, outputs, strict=True):
            sample.teacher_logprobs = samples.encode_logprobs(_response_logprobs(output, sample, engine.url))

    async def close(self) -> None:
        await self.pool.close()


def _response_logprobs(output: dict, sample: common_pb2.Sample, url: str) -> list[float]:
    """The log-probs of the sample's response tokens among the teacher's `input_token_logprobs` (whose first entry,
    for the first token, has none)."""
    entries = (output.get("meta_info") or {}).get("input_token_logprobs") or []
    values = [entry[0] for entry in entries[1:]]
    if len(values) < sample.response_length or any(v is None for v in values[-sample.response_length :]):
        raise Unavailable(
            f"teacher {url} gave {len(values)} input log-probs for sample {sample.sample_id}, whose response has "
            f"{sample.response_length} tokens"
        )
    return [float(v) for v in values[-sample.response_length :]]
