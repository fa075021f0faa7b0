"""Rollout workers: lease a prompt group from the buffer, generate its samples through the engine pool
(token-in/token-out, with log-probs), score them through the reward service, submit the group. A group that cannot
be finished (no engine, reward service down) is released back to the buffer, so nothing is lost.
"""

import asyncio
import contextlib
import logging

import grpc
import prometheus_client

from services.common.errors import SlipstreamError
from services.rollout.config import RolloutConfig
from services.rollout.engines import Engine, EnginePool
from slipstream import samples as arrays
from slipstream.v1 import buffer_pb2, common_pb2, reward_pb2

log = logging.getLogger(__name__)

SAMPLES = prometheus_client.Counter("slipstream_rollout_samples", "Samples generated, by status", ["status"])
TOKENS = prometheus_client.Counter("slipstream_rollout_response_tokens", "Response tokens generated")
GROUPS = prometheus_client.Counter(
    "slipstream_rollout_groups", "Groups finished: submitted, returned to the buffer, all rewards equal", ["outcome"]
)
RESPONSE_LENGTH = prometheus_client.Histogram(
    "slipstream_rollout_response_length", "Response length in tokens", buckets=(16, 64, 256, 1024, 4096, 16384, 65536)
)

_STATUS = {
    "stop": common_pb2.SAMPLE_STATUS_COMPLETED,
    "length": common_pb2.SAMPLE_STATUS_TRUNCATED,
    "abort": common_pb2.SAMPLE_STATUS_ABORTED,
}


class Rollout:
    def __init__(self, config: RolloutConfig, pool: EnginePool, buffer, reward):
        self.config, self.pool, self.buffer, self.reward = config, pool, buffer, reward
        self._loop_task: asyncio.Task | None = None
        self._groups: set[asyncio.Task] = set()

    def start(self) -> bool:
        if self._loop_task is not None and not self._loop_task.done():
            return False
        self._loop_task = asyncio.create_task(self._lease_loop())
        return True

    async def stop(self, abort_in_flight: bool) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        if abort_in_flight:
            for task in list(self._groups):
                task.cancel()
        await asyncio.gather(*self._groups, return_exceptions=True)

    async def _lease_loop(self) -> None:
        slots = asyncio.Semaphore(self.config.rollout_concurrency)
        while True:
            await slots.acquire()
            try:
                request = buffer_pb2.LeasePromptsRequest(max_groups=1, lease_seconds=self.config.lease_seconds)
                reply = await self.buffer.LeasePrompts(request, timeout=30)
            except grpc.aio.AioRpcError as e:
                slots.release()
                log.warning("leasing from the buffer failed: %s", e.details())
                await asyncio.sleep(1.0)
                continue
            if not reply.leases:
                slots.release()
                await asyncio.sleep(1.0 if reply.blocked == buffer_pb2.LEASE_BLOCK_EXHAUSTED else 0.2)
                continue
            task = asyncio.create_task(self._group(reply.leases[0]))
            self._groups.add(task)
            task.add_done_callback(lambda t: (self._groups.discard(t), slots.release()))

    async def _group(self, lease: buffer_pb2.Lease) -> None:
        group = lease.group
        keepalive = asyncio.create_task(self._extend(lease.lease_id))
        try:
            done = await self._generate(group)
            await self._score(done)
            await self.buffer.SubmitGroup(
                buffer_pb2.SubmitGroupRequest(lease_id=lease.lease_id, group=done), timeout=60
            )
            self._count(done)
        except asyncio.CancelledError:
            await self._release(lease.lease_id, "rollout stopped")
            raise
        except (SlipstreamError, grpc.aio.AioRpcError) as e:
            reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            log.warning("group %s goes back to the buffer: %s", group.group_id, reason)
            GROUPS.labels("returned").inc()
            await self._release(lease.lease_id, reason)
        finally:
            keepalive.cancel()

    @staticmethod
    def _count(group: common_pb2.PromptGroup) -> None:
        GROUPS.labels("submitted").inc()
        if len({s.reward for s in group.samples}) == 1 and len(group.samples) > 1:
            GROUPS.labels("zero_std").inc()
        for sample in group.samples:
            SAMPLES.labels(common_pb2.SampleStatus.Name(sample.status).removeprefix("SAMPLE_STATUS_").lower()).inc()
            TOKENS.inc(sample.response_length)
            RESPONSE_LENGTH.observe(sample.response_length)

    async def _generate(self, group: common_pb2.PromptGroup) -> common_pb2.PromptGroup:
        kept = [
            s
            for s in group.samples
            if s.status in (common_pb2.SAMPLE_STATUS_COMPLETED, common_pb2.SAMPLE_STATUS_TRUNCATED)
        ]
        need = group.n_samples - len(kept)
        done = common_pb2.PromptGroup()
        done.CopyFrom(group)
        del done.samples[:]
        done.samples.extend(kept)
        if need > 0:
            payload = {
                "input_ids": arrays.decode_tokens(group.prompt_tokens).tolist(),
                "sampling_params": self._sampling(need),
                "return_logprob": True,
            }
            answer, engine = await self.pool.generate(payload, affinity=group.group_id)
            for output in answer if isinstance(answer, list) else [answer]:
                done.samples.append(_sample(group, output, engine, len(done.samples)))
        return done

    def _sampling(self, n: int) -> dict:
        c = self.config
        params = {"temperature": c.rollout_temperature, "top_p": c.rollout_top_p, "top_k": c.rollout_top_k,
                  "max_new_tokens": c.rollout_max_response_len, "n": n}  # fmt: skip
        if c.rollout_stop:
            params["stop"] = c.rollout_stop
        if c.rollout_stop_token_ids:
            params["stop_token_ids"] = c.rollout_stop_token_ids
        return params

    async def _score(self, group: common_pb2.PromptGroup) -> None:
        items = [
            reward_pb2.RewardItem(
                item_id=s.sample_id,
                prompt=group.prompt_text,
                response=s.response_text.encode(),
                label=group.label,
                metadata=group.metadata,
            )
            for s in group.samples
        ]
        reply = await self.reward.Score(reward_pb2.ScoreRequest(items=items, rm_type=self.config.rm_type), timeout=600)
        for sample, result in zip(group.samples, reply.results, strict=True):
            sample.reward = result.reward
            sample.reward_details.clear()
            sample.reward_details.update(result.details)
            if result.error:
                sample.status_message = result.error_message

    async def _extend(self, lease_id: str) -> None:
        while True:
            await asyncio.sleep(self.config.lease_seconds / 3)
            with contextlib.suppress(grpc.aio.AioRpcError):
                request = buffer_pb2.ExtendLeaseRequest(lease_ids=[lease_id], lease_seconds=self.config.lease_seconds)
                await self.buffer.ExtendLease(request, timeout=30)

    async def _release(self, lease_id: str, reason: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.buffer.ReleaseLease(buffer_pb2.ReleaseLeaseRequest(lease_id=lease_id, reason=reason), timeout=30)


def _sample(group: common_pb2.PromptGroup, output: dict, engine: Engine, index: int) -> common_pb2.Sample:
    """A Sample from one SGLang /generate answer: token ids in and out, log-probs aligned with the output tokens."""
    meta = output["meta_info"]
    response = output["output_ids"]
    prompt = arrays.decode_tokens(group.prompt_tokens)
    logprobs = [entry[0] for entry in meta.get("output_token_logprobs", [])]
    finish = (meta.get("finish_reason") or {}).get("type", "abort")
    sample = common_pb2.Sample(
        sample_id=f"{group.group_id}/{index}",
        index=index,
        tokens=arrays.encode_tokens([*prompt.tolist(), *response]),
        prompt_length=len(prompt),
        response_length=len(response),
        response_text=output.get("text", ""),
        loss_mask=arrays.encode_mask([1] * len(response)),
        rollout_logprobs=arrays.encode_logprobs(logprobs),
        status=_STATUS.get(finish, common_pb2.SAMPLE_STATUS_FAILED),
        engine_url=engine.url,
    )
    for span in meta.get("weight_versions") or [
        {"version": meta.get("weight_version", ""), "start": 0, "end": len(response)}
    ]:
        sample.weight_versions.append(
            common_pb2.WeightVersionSpan(version=str(span["version"]), start=span["start"], end=span["end"])
        )
    return sample
