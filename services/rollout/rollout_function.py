"""slime's whole-rollout function (`--rollout-function-path`) on the gateway's workers.

`generate_rollout(args, rollout_id, data_source, evaluation=False)` runs in a thread, call after call. Its
`data_source.get_samples(n)` leases n prompt groups from the buffer and hands them over as slime's groups of `Sample`
(prompt, prompt tokens, label, metadata); it generates through `http://{args.sglang_router_ip}:
{args.sglang_router_port}/generate`, the gateway's engine pool behind an endpoint on this machine (its routing,
retries and weight-sync pauses); it returns the groups as `list[list[Sample]]` or as an object with `.samples`
(slime's RolloutFnTrainOutput). Each returned group is scored by the reward service unless all its samples have a
reward, and submitted under its lease; a group it did not return, one with an aborted sample, and one that fails its
checks go back to the buffer, so nothing leased is lost."""

import asyncio
import contextlib
import logging
import time

import grpc
from aiohttp import web
from redis.exceptions import RedisError

from services.common.errors import SlipstreamError
from services.common.slime_api import TO_PROTO, Sample, Status, args_of, metadata_of
from services.rollout.generate import check_samples
from slipstream import samples as arrays
from slipstream.v1 import buffer_pb2, common_pb2

log = logging.getLogger(__name__)


class GenerateEndpoint:
    """POST /generate on 127.0.0.1: SGLang's request, answered by an engine of the pool. Requests wait while the
    engines are paused for a weight sync."""

    def __init__(self, pool):
        self.pool = pool
        self.runner: web.AppRunner | None = None
        self.served: set[str] = set()  # the weight versions of the answers since the caller last cleared it

    async def start(self) -> int:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/generate", self._generate)
        # A stop cuts the calls' requests in flight instead of waiting for them (aiohttp's default: up to 60 s): the
        # stopped call's groups go back to the buffer whatever they would have answered.
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _generate(self, request: web.Request) -> web.Response:
        try:
            payload = await request.json()
        except ValueError:
            return web.json_response({"error": "the body must be SGLang's /generate request as JSON"}, status=400)
        if not isinstance(payload, dict) or payload.get("stream"):
            return web.json_response({"error": "one JSON object, without stream: the answer comes whole"}, status=400)
        await self.pool.running.wait()
        try:
            answer, _ = await self.pool.generate(payload)
        except SlipstreamError as e:
            return web.json_response({"error": str(e)}, status=503)
        for output in answer if isinstance(answer, list) else [answer]:
            self.served.add(str(output.get("meta_info", {}).get("weight_version", "")))
        return web.json_response(answer)


class DataSource:
    """slime's data source over the buffer: `get_samples(n)` leases n groups; `add_samples(groups)` gives groups back.
    Called from the rollout function's thread; the leases are taken and kept alive on the gateway's loop."""

    def __init__(self, rollout, loop: asyncio.AbstractEventLoop, args):
        self.rollout, self.loop, self.args = rollout, loop, args
        self.leases: dict[int, buffer_pb2.Lease] = {}  # by the group_index its samples carry
        self.closed = False  # the call is over (or the rollout stopped): nothing more is leased
        self._taking: set[asyncio.Task] = set()
        self._next = 0

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        return asyncio.run_coroutine_threadsafe(self._take(num_samples), self.loop).result()

    async def close(self) -> None:
        """On the gateway's loop: ends the leasing of a call whose thread may still run (a thread cannot be stopped:
        its get_samples fails from now on), once what was being leased has gone back to the buffer."""
        self.closed = True
        for task in self._taking:
            task.cancel()
        await asyncio.gather(*self._taking, return_exceptions=True)

    def add_samples(self, samples: list[list[Sample]]) -> None:
        for group in samples:
            lease = self.leases.pop(group[0].group_index, None) if group else None
            if lease is not None:
                asyncio.run_coroutine_threadsafe(self.rollout._release(lease.lease_id, "given back"), self.loop)

    def __len__(self) -> int:
        return len(self.leases)

    async def _take(self, num_groups: int) -> list[list[Sample]]:
        rollout, taken = self.rollout, []
        self._taking.add(asyncio.current_task())
        try:
            while len(taken) < num_groups and not self.closed:
                await rollout.pool.running.wait()
                rollout.pool.committed.clear()
                reply = await rollout._lease(num_groups - len(taken))
                if not reply.leases and reply.blocked == buffer_pb2.LEASE_BLOCK_EXHAUSTED and not taken:
                    await asyncio.sleep(1.0)
                elif not reply.leases:  # the staleness bound: leases resume once this gateway's weight sync commits
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(rollout.pool.committed.wait(), 0.2)
                taken += reply.leases
            if self.closed:
                raise asyncio.CancelledError
        except asyncio.CancelledError:
            for lease in taken:
                await rollout._release(lease.lease_id, "rollout stopped")
            raise
        finally:
            self._taking.discard(asyncio.current_task())
        groups = []
        self.args.n_samples_per_prompt = taken[0].group.n_samples if taken else self.args.n_samples_per_prompt
        for lease in taken:
            self.leases[self._next] = lease
            groups.append([self._sample(lease.group, self._next, j) for j in range(lease.group.n_samples)])
            self._next += 1
        return groups

    @staticmethod
    def _sample(group: common_pb2.PromptGroup, index: int, j: int) -> Sample:
        return Sample(
            group_index=index,
            index=index * group.n_samples + j,
            prompt=group.prompt_text,
            tokens=arrays.decode_tokens(group.prompt_tokens).tolist(),
            label=group.label,
            metadata=metadata_of(group),
        )


async def run(rollout, function) -> None:
    """The rollout loop with a user's rollout function: one call after another until the rollout stops."""
    endpoint = GenerateEndpoint(rollout.pool)
    port = await endpoint.start()
    # n_samples_per_prompt is the run's (a run fact), and each leased group's own from the first one on
    args = args_of(rollout.config, sglang_router_ip="127.0.0.1", sglang_router_port=port)
    rollout_id = 0
    try:
        while True:
            await rollout.pool.running.wait()
            if not rollout.pool.generating() and rollout.pool.router is None:
                await asyncio.sleep(0.5)
                continue
            source = DataSource(rollout, asyncio.get_running_loop(), args)
            keepalive = asyncio.create_task(_keep_alive(rollout, source))
            endpoint.served.clear()
            try:
                output = await asyncio.to_thread(function, args, rollout_id, source, evaluation=False)
                groups = output.samples if hasattr(output, "samples") else output
                # Samples that do not say which weights made them count as made by the oldest served in the call.
                versions = [int(v) for v in endpoint.served if v.isdigit()]
                await _finish(rollout, source, groups or [], str(min(versions)) if versions else "")
                log.info("rollout function call %d: %d group(s) returned", rollout_id, len(groups or []))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the rollout function (--rollout-function-path) failed; its groups go back to the buffer")
                await asyncio.sleep(1.0)
            finally:
                await source.close()
                keepalive.cancel()
                for lease in source.leases.values():
                    await rollout._release(lease.lease_id, "not returned by the rollout function")
            rollout_id += 1
    finally:
        await endpoint.close()


async def _keep_alive(rollout, source: DataSource) -> None:
    while True:
        await asyncio.sleep(rollout.config.lease_seconds / 3)
        ids = [lease.lease_id for lease in source.leases.values()]
        if ids:
            with contextlib.suppress(grpc.aio.AioRpcError):
                request = buffer_pb2.ExtendLeaseRequest(lease_ids=ids, lease_seconds=rollout.config.lease_seconds)
                await rollout.buffer.ExtendLease(request, timeout=30)


async def _finish(rollout, source: DataSource, groups: list[list[Sample]], oldest: str) -> None:
    for samples in groups:
        index = samples[0].group_index if samples else None
        lease = source.leases.get(index)
        if lease is None:
            log.warning("the rollout function returned a group its data source did not hand out; it is left out")
            continue
        try:
            group = _group(lease.group, samples, oldest)
            if any(s.status == common_pb2.SAMPLE_STATUS_ABORTED for s in group.samples):
                await rollout._release(lease.lease_id, "aborted by a pause")
            else:
                if any(s.reward is None for s in samples):
                    await rollout._score(group)
                group.timings["scored"] = time.time()
                await rollout._submit(lease, group)
                rollout._count(group)
        except (SlipstreamError, grpc.aio.AioRpcError, RedisError, ValueError, TypeError) as e:
            reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            log.warning("group %s goes back to the buffer: %s", lease.group.group_id, reason)
            await rollout._release(lease.lease_id, reason)
        del source.leases[index]  # submitted or given back; a stop in between leaves it to run()'s release


def _group(leased: common_pb2.PromptGroup, samples: list[Sample], oldest: str) -> common_pb2.PromptGroup:
    """The leased group with the function's samples, checked as a custom generate function's are. slime's samples
    list the weight versions that generated them (without their spans: each covers the response here); a sample that
    lists none gets `oldest`."""
    group = common_pb2.PromptGroup()
    group.CopyFrom(leased)
    del group.samples[:]
    produced = []
    for s in samples:
        n = s.response_length
        sample = common_pb2.Sample(
            tokens=arrays.encode_tokens(s.tokens),
            prompt_length=len(s.tokens) - n,
            response_length=n,
            response_text=s.response,
            loss_mask=arrays.encode_mask(s.loss_mask if s.loss_mask is not None else [1] * n),
            rollout_logprobs=arrays.encode_logprobs(s.rollout_log_probs or []),
            reward=_reward(s.reward),
            status=TO_PROTO[s.status if s.status != Status.PENDING else Status.COMPLETED],
        )
        for version in dict.fromkeys(s.weight_versions or ([oldest] if oldest else [])):
            sample.weight_versions.add(version=str(version), start=0, end=n)
        if s.metadata:
            sample.metadata.update(s.metadata)
        produced.append(sample)
    group.samples.extend(check_samples(group, produced, "rollout function (--rollout-function-path)"))
    return group


def _reward(reward) -> float:
    if reward is None or isinstance(reward, int | float):
        return float(reward or 0.0)
    raise TypeError(f"a sample's reward must be a number (or None: scored by the reward service), got {reward!r}")
