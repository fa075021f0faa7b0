"""Rollout workers: lease a prompt group from the buffer, generate its samples through the engine pool
(token-in/token-out, with log-probs) or a custom generate function, score them through the reward service, submit
the group. A group that cannot be finished (no engine, reward service down, a failing custom function, or a pause
that aborted its requests) is released back to the buffer with what it has, so nothing is lost.
"""

import asyncio
import collections
import contextlib
import logging
import time

import grpc
import prometheus_client
from redis.exceptions import RedisError

from services.buffer import dataplane
from services.common.errors import SlipstreamError
from services.common.plugins import load_callable
from services.common.waits import logged_wait
from services.rollout.config import RolloutConfig
from services.rollout.engines import EnginePool
from services.rollout.generate import GenerateContext, check_samples, generate_group, mask_offpolicy
from services.rollout.scoring import ScoreBatcher, reward_error
from services.rollout.submits import SubmitBatcher
from slipstream import samples
from slipstream.v1 import buffer_pb2, common_pb2, reward_pb2

log = logging.getLogger(__name__)

SAMPLES = prometheus_client.Counter("slipstream_rollout_samples", "Samples generated, by status", ["status"])
TOKENS = prometheus_client.Counter("slipstream_rollout_response_tokens", "Response tokens generated")
GROUPS = prometheus_client.Counter(
    "slipstream_rollout_groups",
    "Groups finished: submitted, returned to the buffer, returned partial (paused), all rewards equal",
    ["outcome"],
)
RESPONSE_LENGTH = prometheus_client.Histogram(
    "slipstream_rollout_response_length", "Response length in tokens", buckets=(16, 64, 256, 1024, 4096, 16384, 65536)
)
# Groups a lease call asks for at most while groups are scarce (at first, and after the buffer gave fewer than asked:
# a staleness or backpressure bound is near), so that one gateway cannot take a whole small step's prompts from the
# others. Each call the buffer answers in full doubles it, up to every free slot: a gateway then leases all its free
# slots in one call, and the slower the buffers answer, the more slots each call carries.
LEASE_BATCH = 8
LEASE_SECONDS = prometheus_client.Histogram(
    "slipstream_rollout_lease_seconds",
    "A LeasePrompts call's time, as the gateway waits for it",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
)
THROUGHPUT = prometheus_client.Gauge(
    "slipstream_rollout_throughput", "Over the last minute: samples/s, tokens/s, truncated ratio", ["measure"]
)


class Rollout:
    def __init__(
        self,
        config: RolloutConfig,
        pool: EnginePool,
        buffer,
        reward,
        tokenizer=None,
        redis=None,
        failed=None,
        teacher=None,
    ):
        """`failed`: a future that is given the error that must stop the gateway (another data-plane layout);
        `teacher`: on-policy distillation's teacher engines (teacher.Teacher), asked for each training group."""
        self.config, self.pool, self.buffer, self.reward, self.tokenizer = config, pool, buffer, reward, tokenizer
        self.teacher = teacher
        self.redis = redis  # the buffer's Redis (--redis-url): training groups are completed or uploaded there
        self.failed: asyncio.Future | None = failed
        self.scorer = ScoreBatcher(reward)
        self.submitter = SubmitBatcher()
        self._planes: dict[str, dataplane.DataPlane] = {}  # by the run's namespace, its layout checked
        self.custom = None
        if config.custom_generate_function_path:
            self.custom = load_callable(config.custom_generate_function_path, "--custom-generate-function-path")
        self.eval_custom = {  # eval sets' own generate functions (--eval-config)
            s.name: load_callable(s.custom_generate_function_path, f"--eval-config set {s.name!r}: generate function")
            for s in config.eval_sets()
            if s.custom_generate_function_path
        }
        self.function = None
        if config.rollout_function_path:
            self.function = load_callable(config.rollout_function_path, "--rollout-function-path")
        self.window = Window()
        self._loop_task: asyncio.Task | None = None
        self._groups: set[asyncio.Task] = set()
        self._failures = 0  # consecutive groups that went back to the buffer: back off before the next lease

    @property
    def running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    def start(self) -> bool:
        if self.running:
            return False
        if self.function is not None:
            from services.rollout import rollout_function

            self._loop_task = asyncio.create_task(rollout_function.run(self, self.function))
        else:
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
        """Leases groups for free slots, one call for all the slots free at once. While a call is out, a second one
        goes out once half as many slots as the last full call carried are free: the slots freed meanwhile need not
        wait for the first to come back (a call takes a busy buffer tens of milliseconds), and calls stay large."""
        slots = asyncio.Semaphore(self.config.rollout_concurrency)
        most, want, calls, acquire = LEASE_BATCH, 0, set(), None
        try:
            while True:
                acquire = acquire or asyncio.ensure_future(slots.acquire())
                finished, _ = await asyncio.wait({acquire, *calls}, return_when=asyncio.FIRST_COMPLETED)
                for call in finished - {acquire}:
                    calls.discard(call)
                    asked, leases, short = call.result()
                    most = LEASE_BATCH if short else min(2 * most, self.config.rollout_concurrency)
                    for _ in range(asked - len(leases)):
                        slots.release()
                    for lease in leases:
                        task = asyncio.create_task(self.run_group(lease, self.sampling()))
                        self._groups.add(task)
                        task.add_done_callback(lambda t: (self._groups.discard(t), slots.release()))
                if acquire.done():
                    acquire, want = None, want + 1
                    while want < most and not slots.locked():
                        await slots.acquire()  # returns at once: the semaphore is not locked
                        want += 1
                if want and (not calls or (len(calls) == 1 and want >= most // 2)):
                    calls.add(asyncio.create_task(self._leases_for(want)))
                    want = 0
        finally:
            for pending in [*calls, *([acquire] if acquire else [])]:
                pending.cancel()
            await asyncio.gather(*calls, return_exceptions=True)

    async def _leases_for(self, want: int) -> tuple[int, list[buffer_pb2.Lease], bool]:
        with logged_wait(log, "a prompt group to lease") as notes:
            leases, short = await self._next_leases(want, notes)
        return want, leases, short

    async def _next_leases(self, want: int, notes: list[str]) -> tuple[list[buffer_pb2.Lease], bool]:
        """Up to `want` leased groups, once the engines run and the buffer has any, and whether the buffer gave fewer
        than asked on the way (groups are scarce); `notes` say why it waited."""
        short = False
        while True:
            if not self.pool.running.is_set():
                notes.append("engines paused for a weight sync")
                await self.pool.running.wait()  # no new groups while the engines are paused
            if not self.pool.generating() and self.pool.router is None:  # none to generate on (yet)
                notes.append("no healthy engine")
                await asyncio.sleep(0.5)
                continue
            self.pool.committed.clear()
            try:
                reply = await self._lease(want)
            except grpc.aio.AioRpcError as e:
                notes.append(f"leasing failed: {e.details()}")
                log.warning("leasing from the buffer failed: %s", e.details())
                await asyncio.sleep(1.0)
                continue
            short = short or len(reply.leases) < want
            if reply.leases:
                return list(reply.leases), short
            want = min(want, LEASE_BATCH)  # groups are scarce: a few at a time once they come
            blocked = buffer_pb2.LeaseBlock.Name(reply.blocked).removeprefix("LEASE_BLOCK_").lower()
            note = f"the buffer gave none: {blocked.replace('unspecified', 'no reason given')}"
            if note not in notes:
                notes.append(note)
            if reply.blocked == buffer_pb2.LEASE_BLOCK_UNSPECIFIED:  # other buffer replicas leased the same prompts
                continue  # the buffer retried already: ask again at once
            if reply.blocked == buffer_pb2.LEASE_BLOCK_EXHAUSTED:
                await asyncio.sleep(1.0)
            else:  # synchronous training: leases resume the moment this gateway's weight sync is committed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.pool.committed.wait(), 0.2)

    async def _lease(self, max_groups: int = 1) -> buffer_pb2.LeasePromptsResponse:
        """One LeasePrompts call that a stop cannot cut in half: if the rollout stops while the call is out, what it
        leased goes straight back to the buffer instead of waiting for its lease to expire."""
        request = buffer_pb2.LeasePromptsRequest(max_groups=max_groups, lease_seconds=self.config.lease_seconds)
        call = asyncio.ensure_future(self.buffer.LeasePrompts(request, timeout=30))
        try:
            with LEASE_SECONDS.time():
                return await asyncio.shield(call)
        except asyncio.CancelledError:
            with contextlib.suppress(grpc.aio.AioRpcError):
                for lease in (await call).leases:
                    await self._release(lease.lease_id, "rollout stopped")
            raise

    async def run_group(self, lease: buffer_pb2.Lease, sampling: dict, n: int = 0):
        """Generates, scores and submits one leased group; returns it, or None when it went back to the buffer."""
        group = lease.group
        if n:
            group.n_samples = n
        keepalive = asyncio.create_task(self._extend(lease.lease_id))
        try:
            done = common_pb2.PromptGroup()
            done.CopyFrom(group)
            del done.samples[:]
            done.timings["leased"] = time.time()
            with logged_wait(log, "group %s to generate", group.group_id):
                done.samples.extend(await self._generate(group, sampling))
                while group.dataset not in ("", "train") and _aborted(done):
                    await self._finish_evaluated(group, done, sampling)
            if _aborted(done):
                GROUPS.labels("partial").inc()  # paused mid-response: the buffer keeps what was generated
                await self._release(lease.lease_id, "aborted by a pause", list(done.samples))
                return None
            done.timings["generated"] = time.time()
            with logged_wait(log, "group %s to be scored", group.group_id):
                if self.teacher is not None and done.dataset in ("", "train"):
                    await asyncio.gather(self._score(done), self.teacher.annotate(done))
                else:
                    await self._score(done)
            done.timings["scored"] = time.time()
            with logged_wait(log, "group %s to be submitted", group.group_id):
                await self._submit(lease, done)
            self._count(done)
            self._failures = 0
            return done
        except asyncio.CancelledError:
            await self._release(lease.lease_id, "rollout stopped")
            raise
        except (SlipstreamError, grpc.aio.AioRpcError, RedisError) as e:
            reason = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            log.warning("group %s goes back to the buffer: %s", group.group_id, reason)
        except Exception as e:  # a custom generate function's own failure must not lose the group
            reason = f"{type(e).__name__}: {e}"
            log.exception("group %s goes back to the buffer: the generate function failed", group.group_id)
        finally:
            keepalive.cancel()
        GROUPS.labels("returned").inc()
        await self._release(lease.lease_id, reason)
        self._failures += 1  # a group that fails again and again must not spin: its slot waits before it is freed
        await asyncio.sleep(min(0.05 * 2**self._failures, 5.0))
        return None

    async def _submit(self, lease: buffer_pb2.Lease, group: common_pb2.PromptGroup) -> None:
        """With the buffer's Redis at hand, a training group is completed there, in one round trip with the other
        groups finished at the same moment (the lease names the run's namespace unless the buffer has a
        dynamic-sampling filter to run on it); or its arrays go there and the buffer gets the rest. Either way the
        bulk crosses to Redis once and from there to the trainer (docs/buffer.md, the data plane)."""
        if self.redis is not None and lease.submit_namespace:
            await self.submitter.complete(await self._plane(lease.submit_namespace), lease, group)
            return
        request = buffer_pb2.SubmitGroupRequest(lease_id=lease.lease_id, group=group)
        if self.redis is not None and lease.upload_key and group.dataset == "train":
            await self._plane(dataplane.namespace_of(lease.upload_key))
            await self.redis.set(lease.upload_key, samples.take_arrays(request.group), ex=dataplane.UPLOAD_TTL_S)
            request.arrays_in_redis = True
        await self.buffer.SubmitGroup(request, timeout=60)

    async def _plane(self, ns: str) -> dataplane.DataPlane:
        """The run's data plane in the buffer's Redis; the first time, its layout is checked: another one stops the
        gateway (its group goes back to the buffer)."""
        if ns not in self._planes:
            plane = dataplane.DataPlane(self.redis, ns)
            try:
                await plane.check_layout()
            except dataplane.LayoutMismatch as e:
                if self.failed is not None and not self.failed.done():
                    self.failed.set_exception(e)
                raise
            self._planes[ns] = plane
        return self._planes[ns]

    async def _generate(self, group: common_pb2.PromptGroup, sampling: dict, resume: bool | None = None) -> list:
        ctx = GenerateContext(self.pool, sampling, self.config, self.tokenizer, self.reward, affinity=group.group_id)
        custom = self.eval_custom.get(group.dataset, self.custom)
        if self.config.partial_rollout and self.config.mask_offpolicy_in_partial_rollout:
            mask_offpolicy(group)
        if custom is None:
            return await generate_group(ctx, group, resume=self.config.partial_rollout if resume is None else resume)
        return check_samples(group, await custom(ctx, group))

    async def _finish_evaluated(self, group: common_pb2.PromptGroup, done: common_pb2.PromptGroup, sampling: dict):
        """An eval group that a weight sync paused continues where it stopped once the sync is over, rather than go
        back to the buffer: an evaluation pass is every prompt of its set, and a group sent back started over each
        time (with --async-buffer-size a sync comes every step, sooner than some groups finish), or was left out of
        its pass and made the next one on its own."""
        await self.pool.running.wait()
        del group.samples[:]
        group.samples.extend(done.samples)
        resumed = await self._generate(group, sampling, resume=True)
        del done.samples[:]
        done.samples.extend(resumed)

    def sampling(
        self, overrides: common_pb2.SamplingParams | None = None, evaluation: bool = False, dataset: str = ""
    ) -> dict:
        """SGLang sampling_params of rollouts (or of evaluation: --eval-* where set, then the eval set's own from
        --eval-config), with `overrides` applied."""
        c = self.config
        params = {
            "temperature": c.rollout_temperature,
            "top_p": c.rollout_top_p,
            "top_k": c.rollout_top_k,
            "max_new_tokens": c.rollout_max_response_len,
        }
        if evaluation:
            evals = {
                "temperature": c.eval_temperature,
                "top_p": c.eval_top_p,
                "top_k": c.eval_top_k,
                "max_new_tokens": c.eval_max_response_len,
            }
            params.update({k: v for k, v in evals.items() if v is not None})
        if c.rollout_stop:
            params["stop"] = c.rollout_stop
        if c.rollout_stop_token_ids:
            params["stop_token_ids"] = c.rollout_stop_token_ids
        if evaluation:
            if c.eval_min_new_tokens is not None:
                params["min_new_tokens"] = c.eval_min_new_tokens
            if eval_set := c.eval_sets().get(dataset):
                params.update(eval_set.sampling())
        if overrides is not None:
            for descriptor, value in overrides.ListFields():
                params[descriptor.name] = list(value) if descriptor.is_repeated else value
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
        if self.config.group_rm:
            request = reward_pb2.ScoreGroupRequest(items=items, rm_type=self.config.rm_type)
            results = (await self.reward.ScoreGroup(request, timeout=600)).results
        else:  # with the items of other groups ready now, in one call
            results = await self.scorer.score(items, self.config.rm_type)
        key = self.config.eval_reward_key if group.dataset not in ("", "train") else None
        for sample, result in zip(group.samples, results, strict=True):
            sample.reward = result.reward
            sample.reward_details.clear()
            sample.reward_details.update(result.details)
            if result.error:
                sample.status, sample.status_message = common_pb2.SAMPLE_STATUS_FAILED, result.error_message
                sample.reward_error.CopyFrom(reward_error(result, self.config.rm_type))
            elif key and key in result.details:  # a dict's numbers are its details
                sample.reward = result.details[key]
            elif key and result.details:  # a dict without it (a plain number has no details: it stays)
                found = ", ".join(result.details)
                sample.status = common_pb2.SAMPLE_STATUS_FAILED
                sample.status_message = f"--eval-reward-key {key}: the reward has no {key!r}, only {found}"
                log.warning("eval set %s: %s", group.dataset, sample.status_message)

    def _count(self, group: common_pb2.PromptGroup) -> None:
        GROUPS.labels("submitted").inc()
        if len({s.reward for s in group.samples}) == 1 and len(group.samples) > 1:
            GROUPS.labels("zero_std").inc()
        for sample in group.samples:
            SAMPLES.labels(common_pb2.SampleStatus.Name(sample.status).removeprefix("SAMPLE_STATUS_").lower()).inc()
            TOKENS.inc(sample.response_length)
            RESPONSE_LENGTH.observe(sample.response_length)
        self.window.add(group.samples)

    async def _extend(self, lease_id: str) -> None:
        while True:
            await asyncio.sleep(self.config.lease_seconds / 3)
            with contextlib.suppress(grpc.aio.AioRpcError):
                request = buffer_pb2.ExtendLeaseRequest(lease_ids=[lease_id], lease_seconds=self.config.lease_seconds)
                await self.buffer.ExtendLease(request, timeout=30)

    async def _release(self, lease_id: str, reason: str, partial: list | None = None) -> None:
        """Gives a lease back. A stop that cancels the caller meanwhile waits for the release to land instead of
        cutting it short (the group would wait out its lease)."""
        request = buffer_pb2.ReleaseLeaseRequest(lease_id=lease_id, reason=reason, partial_samples=partial or [])
        call = asyncio.ensure_future(self.buffer.ReleaseLease(request, timeout=10))  # one Lua call: quick
        call.add_done_callback(lambda done: done.cancelled() or done.exception())  # its error is handled here
        try:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await asyncio.shield(call)
        except asyncio.CancelledError:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await asyncio.shield(call)
            raise


class Window:
    """Samples/s, tokens/s and the truncated ratio over the last minute, for the throughput gauges. Running sums: a
    gateway adds thousands of samples a second, and summing the whole minute on each would cost it a core."""

    def __init__(self, seconds: float = 60.0):
        self.seconds = seconds
        self.events: collections.deque[tuple[float, int, bool]] = collections.deque()
        self.tokens = self.truncated = 0

    def add(self, samples) -> None:
        if not samples:
            return
        now = time.monotonic()
        for s in samples:
            event = (now, s.response_length, s.status == common_pb2.SAMPLE_STATUS_TRUNCATED)
            self.events.append(event)
            self.tokens, self.truncated = self.tokens + event[1], self.truncated + event[2]
        while self.events[0][0] <= now - self.seconds:
            _, tokens, truncated = self.events.popleft()
            self.tokens, self.truncated = self.tokens - tokens, self.truncated - truncated
        span = max(now - self.events[0][0], 1.0)
        THROUGHPUT.labels("samples_per_s").set(len(self.events) / span)
        THROUGHPUT.labels("tokens_per_s").set(self.tokens / span)
        THROUGHPUT.labels("truncated_ratio").set(self.truncated / len(self.events))


def _aborted(group: common_pb2.PromptGroup) -> bool:
    return any(s.status == common_pb2.SAMPLE_STATUS_ABORTED for s in group.samples)
