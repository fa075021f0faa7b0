"""The buffer's domain logic: who may lease what, which groups are trained at which step, and what gets dropped.

It orchestrates the prompt streams (new groups), the store (all state, in Redis) and the filters. It keeps no
state of its own that matters across a restart: cursors, leases, groups, batches and counters are all in Redis. Any
number of buffer processes serve one run, each transition checked by its store script against the state it was
computed from (`Contended`: look again); the one lock, in Redis, makes the processes read the dataset ahead one at a
time, which saves work and is not needed for correctness.
"""

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass, field

import prometheus_client
from redis.exceptions import RedisError

from services.buffer.config import BufferConfig
from services.buffer.dataplane import submitted_channel
from services.buffer.filters import read_verdict
from services.buffer.groups import check_group, group_id_of, leased_group_id, min_version, num_tokens
from services.buffer.prompts import Skipped
from services.buffer.source import Cursor, PromptStream
from services.buffer.store import BufferStore, Contended, LeaseStart
from services.common.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.common.waits import logged_wait
from slipstream import samples
from slipstream.v1 import common_pb2

log = logging.getLogger(__name__)

TRAIN = "train"


MAX_LEASE_S = 7 * 24 * 3600
ATTEMPTS = 20  # of a transition that other buffer processes keep moving the state under
BATCH_POLL_S = 0.25  # GetBatch looks for groups submitted to other buffer processes this often
FOLLOW_IDLE_S = 1.0  # the submits are followed until this long after the last GetBatch stopped waiting
CONTENDED = prometheus_client.Counter(
    "slipstream_buffer_lease_contended",
    "Read-aheads refused because another buffer process moved the dataset's cursor meanwhile",
)


WAITED = prometheus_client.Counter(
    "slipstream_buffer_lease_waited", "Times a lease found no new group made ahead and waited for a read-ahead"
)


@dataclass
class LeasedGroup:
    lease_id: str
    group: common_pb2.PromptGroup
    deadline_ms: int


@dataclass
class LeaseResult:
    leases: list[LeasedGroup]
    policy_version: int
    blocked: str | None = None  # "backpressure", "staleness" or "exhausted" when no lease could be given


@dataclass
class BatchPart:
    payloads: list[bytes]  # serialized PromptGroups without their arrays, as stored: they go out without a parse
    arrays: list[bytes]  # each group's arrays (samples.take_arrays' form), or none when the caller reads them itself
    arrays_keys: list[str]  # where in Redis each group's arrays are
    num_tokens: int
    total_groups: int
    policy_version: int

    @property
    def groups(self) -> list[common_pb2.PromptGroup]:
        """The groups, with their arrays when the part has them."""
        groups = [common_pb2.PromptGroup.FromString(payload) for payload in self.payloads]
        if self.arrays:
            samples.put_batch_arrays(groups, self.arrays)
        return groups


@dataclass
class Buffer:
    config: BufferConfig
    store: BufferStore
    streams: dict[str, PromptStream]  # "train" and the eval sets
    dynamic_filter: object = None
    buffer_filter: object = None
    _reading: asyncio.Lock = field(default_factory=asyncio.Lock)  # the prompt streams have one reader at a time
    _reads_ahead: dict[str, asyncio.Task] = field(default_factory=dict)  # the background read-ahead of each dataset
    _submitted: asyncio.Event = field(default_factory=asyncio.Event)
    _batch_waits: int = 0  # GetBatch calls of this process waiting for groups: the submits are followed meanwhile
    _wanted: asyncio.Event = field(default_factory=asyncio.Event)  # set while there are some
    _following: asyncio.Event = field(default_factory=asyncio.Event)  # set while subscribed to the submits
    _eval_samples: dict[str, int] = field(default_factory=dict)  # each eval set's samples per prompt

    def __post_init__(self) -> None:
        self._eval_samples = self.config.samples_per_eval_prompt()

    async def start(self) -> None:
        """Declares the data plane's layout in the run's keys (refusing a run of another layout), then positions every
        stream at the cursor stored in Redis (where the previous process stopped)."""
        await self.store.declare_layout()
        for name, stream in self.streams.items():
            stream.reset(Cursor.decode(await self.store.cursor(name)))
            if isinstance(stream, PromptStream):
                stream.share(self.store.redis, self.store.key("prepared"))

    # Leases

    def _lease_ms(self, lease_seconds: float) -> int:
        """A lease's length asked for in a request (0: the configured one), at most a week."""
        if not 0 <= lease_seconds <= MAX_LEASE_S:  # also refuses NaN
            raise InvalidArgument(
                "lease_seconds",
                f"must be 0 (the buffer's --default-lease-seconds) to {MAX_LEASE_S} seconds, got {lease_seconds}",
            )
        return int((lease_seconds or self.config.default_lease_seconds) * 1000)

    async def lease(self, max_groups: int, lease_seconds: float, dataset: str) -> LeaseResult:
        if max_groups < 0:
            raise InvalidArgument("max_groups", f"must be >= 0, got {max_groups}")
        lease_ms = self._lease_ms(lease_seconds)
        dataset = dataset or TRAIN
        if dataset not in self.streams:
            known = ", ".join(sorted(self.streams)) or "none (pass --prompt-data / --eval-prompt-data)"
            raise InvalidArgument("dataset", f"unknown dataset {dataset!r}; known: {known}")
        # Expiry, the returned groups, then new ones made ahead, as the bounds allow: one round trip.
        start, leases = await self._lease_start(dataset, max_groups, lease_ms)
        blocked = None
        with logged_wait(log, "%d new %s groups to lease", max_groups - len(leases), dataset) as notes:
            for attempt in range(ATTEMPTS):
                want = max_groups - len(leases)
                bounds, bound = self._bounds(dataset, start.policy_version)
                room, blocked = self._room(dataset, bounds, bound, start.counters, start.sizes)
                if want <= 0 or room <= 0 or start.sizes["ready"]:  # ready ones left: the bounds stopped the lease
                    break
                WAITED.inc()
                self.streams[dataset].read_more()
                try:
                    if not await self._stage(dataset, want):
                        blocked = "exhausted"
                        break
                except Contended as e:  # another buffer process made groups ahead meanwhile: lease those
                    notes[:] = [f"contended {attempt + 1} times, last: {e}"]
                    CONTENDED.inc()
                start, new = await self._lease_start(dataset, want, lease_ms)
                leases += new
        self._read_ahead(dataset, start.sizes["ready"])
        if leases or max_groups == 0:
            return LeaseResult(leases, start.policy_version)
        return LeaseResult(leases, start.policy_version, blocked)

    async def _lease_start(self, dataset: str, want: int, lease_ms: int) -> tuple[LeaseStart, list[LeasedGroup]]:
        start = await self.store.lease_start(dataset, want, lease_ms, *self._limit(dataset), dataset == TRAIN)
        parse = common_pb2.PromptGroup.FromString
        return start, [LeasedGroup(lid, parse(payload), start.deadline_ms) for _, lid, payload in start.leased]

    def _limit(self, dataset: str) -> tuple[int, tuple[int, int, int]]:
        """`_bounds` for the lease's first script, which reads the policy version itself: the cap, and the limit as
        (per_version, base, fixed) of the version."""
        if dataset != TRAIN:
            return -1, (-1, 0, -1)
        batch = self.config.rollout_batch_size
        fixed = self.config.num_rollout * batch if self.config.num_rollout is not None else -1
        base = self.config.max_staleness * batch + self.config.groups_in_flight
        return self.config.max_buffered_groups or -1, (batch, base, fixed)

    def _bounds(self, dataset: str, version: int) -> tuple[tuple[int, int], str]:
        """(cap, limit) for the store's scripts, and what the limit is: the backpressure cap on leased plus completed
        groups, and the bound on live groups (started, not dropped): the staleness bound (groups that could not be
        trained within --max-staleness versions are not generated) or the run's length (--num-rollout)."""
        if dataset != TRAIN:
            return (-1, -1), ""
        cap = self.config.max_buffered_groups or -1
        batch = self.config.rollout_batch_size
        limit, bound = (version + self.config.max_staleness) * batch + self.config.groups_in_flight, "staleness"
        if self.config.num_rollout is not None and self.config.num_rollout * batch < limit:
            limit, bound = self.config.num_rollout * batch, "exhausted"
        return (cap, limit), bound

    def _room(
        self, dataset: str, bounds: tuple[int, int], bound: str, counters: dict, sizes: dict
    ) -> tuple[int, str | None]:
        """How many new groups may start now, and what blocks them when none may."""
        if dataset != TRAIN:
            return 1 << 30, None
        cap, limit = bounds
        if cap >= 0 and cap - sizes["leased"] - sizes["completed"] <= 0:
            return 0, "backpressure"
        room = limit - (counters.get("started", 0) - counters.get("dropped", 0))
        if cap >= 0:
            room = min(room, cap - sizes["leased"] - sizes["completed"])
        return room, bound if room <= 0 else None

    async def _stage(self, dataset: str, want: int, wait: bool = True) -> bool:
        """Makes at least `want` new groups of the dataset ahead into its ready list (a read-ahead's worth when more),
        unless that many wait there already; False at the end of the data. One buffer process reads ahead at a time
        (a lock in Redis; without `wait`, nothing is done while another one holds it); should the lock expire or be
        waited for too long, the cursor's check makes a second reader's script refuse (`Contended`)."""
        stream = self.streams[dataset]
        async with self._reading:
            lock = self.store.reading_lock(dataset)
            held = await lock.acquire(blocking=wait)
            if not held and not wait:
                return True
            try:
                cursor, ready = await self.store.stage_state(dataset)
                if ready >= want:
                    return True
                expected = (cursor or b"").decode()
                await stream.seek(Cursor.decode(expected))  # where this or another buffer process stopped
                items = await stream.take(max(want - ready, stream.read_ahead))
                if not items:
                    return ready > 0
                # Nothing stored on failure: the next read-ahead seeks the stream back to the stored cursor.
                await self.store.stage(dataset, expected, items[-1].after.encode(), *self._new_groups(dataset, items))
                await stream.forget(items)
                return True
            finally:
                if held:
                    await lock.release()

    def _new_groups(self, dataset: str, items: list) -> tuple[list[tuple[str, bytes]], dict[str, int]]:
        """The stream's items as (group id, payload) pairs, and the rows skipped by reason."""
        groups, skipped, n = [], {}, self._samples_per_group(dataset)
        for item in items:
            if isinstance(item.payload, Skipped):
                skipped[item.payload.reason] = skipped.get(item.payload.reason, 0) + 1
                continue
            # A message's fields appended to its bytes are set on it: the payload is not parsed again.
            own = common_pb2.PromptGroup(group_id=item.group_id, dataset=dataset, epoch=item.after.epoch, n_samples=n)
            groups.append((item.group_id, item.payload + own.SerializeToString()))
        return groups, skipped

    def _read_ahead(self, dataset: str, ready: int) -> None:
        """Tops the dataset's ready list up in the background once a lease left it under a read-ahead, so that the
        next leases find new groups waiting."""
        read_ahead = self.streams[dataset].read_ahead
        if ready >= read_ahead or dataset in self._reads_ahead:
            return
        task = asyncio.create_task(self._stage_quietly(dataset, read_ahead))
        self._reads_ahead[dataset] = task
        task.add_done_callback(lambda _: self._reads_ahead.pop(dataset, None))

    async def _stage_quietly(self, dataset: str, want: int) -> None:
        try:
            await self._stage(dataset, want, wait=False)
        except Contended:  # another buffer process read ahead meanwhile
            CONTENDED.inc()
        except Exception:  # Redis may be briefly unreachable; a lease stages what it needs itself
            log.exception("making %s groups ahead failed", dataset)

    async def close(self) -> None:
        """Stops the read-aheads under way (what they had not stored is read again by the next one)."""
        for task in list(self._reads_ahead.values()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def extend(self, lease_ids: list[str], lease_seconds: float) -> tuple[int, list[str], list[str]]:
        lease_ms = self._lease_ms(lease_seconds)
        if not lease_ids:
            return 0, [], []
        deadline, flags = await self.store.extend(lease_ids, lease_ms)
        extended = [lid for lid, ok in zip(lease_ids, flags, strict=True) if ok]
        return deadline, extended, [lid for lid, ok in zip(lease_ids, flags, strict=True) if not ok]

    async def release(self, lease_id: str, partial_samples: list[common_pb2.Sample]) -> None:
        """Returns a leased group to the pool; its partial samples are kept and come back with the next lease."""
        payload = b""
        if partial_samples:
            stored = await self.store.leased_group(group_id_of(lease_id) or "")
            if stored is None:
                raise NotFound(f"lease {lease_id!r} is not held (unknown, expired or already submitted)")
            group = common_pb2.PromptGroup.FromString(stored)
            del group.samples[:]
            group.samples.extend(partial_samples)
            payload = group.SerializeToString()
        if not await self.store.release(lease_id, payload):
            raise NotFound(f"lease {lease_id!r} is not held (unknown, expired or already submitted)")

    # Submit

    async def submit(
        self, lease_id: str, group: common_pb2.PromptGroup, arrays_in_redis: bool = False
    ) -> tuple[bool, bool, str]:
        """Stores a finished group; returns (accepted, duplicate, filtered reason). Idempotent per group. With
        `arrays_in_redis` the worker uploaded the samples' arrays (store.upload_key); else they are in `group`."""
        group_id = leased_group_id(lease_id)
        dataset = group_id.split(":", 1)[0]
        check_group(group, self._samples_per_group(dataset) if dataset == TRAIN else None, arrays_in_redis)
        group.group_id = group_id
        group.min_weight_version = min_version(group)
        outcome, reason = "completed", ""
        if dataset != TRAIN:
            outcome = f"eval:{dataset}"
        elif self.dynamic_filter is not None:
            verdict = self._run_dynamic_filter(group)
            if not verdict.keep:
                outcome, reason = f"dropped:{verdict.reason}", verdict.reason
        arrays = None
        if not arrays_in_redis:  # stored apart from the rest, as a worker would have uploaded them
            group = _copy(group)
            arrays = samples.take_arrays(group)
        payload, tokens = group.SerializeToString(), num_tokens(group)
        result = await self.store.submit(lease_id, outcome, payload, group.min_weight_version, tokens, arrays)
        if result == "unknown":
            raise NotFound(f"lease {lease_id!r} is unknown to this run; submit with a lease id from LeasePrompts")
        if result == "no_arrays":
            raise FailedPrecondition(
                f"arrays_in_redis: no arrays were uploaded for lease {lease_id!r} (or they expired); write them to "
                f"its upload key first, or send them in the group without arrays_in_redis"
            )
        if result != "accepted":
            return False, True, ""
        if outcome == "completed":
            self._submitted.set()
        return not reason, False, reason

    def _samples_per_group(self, dataset: str) -> int:
        if dataset == TRAIN:
            return self.config.n_samples_per_prompt
        return self._eval_samples.get(dataset, self.config.n_samples_per_eval_prompt)

    def _run_dynamic_filter(self, group: common_pb2.PromptGroup):
        try:
            return read_verdict(self.dynamic_filter(self.config, list(group.samples)))
        except Exception:  # a crashing user filter must not lose the group: keep it, and say so
            log.exception("dynamic sampling filter failed on group %s; keeping the group", group.group_id)
            return read_verdict(True)

    # Batches

    async def get_batch(
        self, step: int, dp_rank: int, dp_size: int, timeout_s: float, arrays_from_redis: bool = False
    ) -> BatchPart:
        batch_size = self.config.rollout_batch_size
        if step < 0:
            raise InvalidArgument("step", f"must be >= 0, got {step}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise InvalidArgument("dp_rank", f"must satisfy 0 <= dp_rank < dp_size, got {dp_rank} of {dp_size}")
        if batch_size % dp_size:
            raise InvalidArgument("dp_size", f"--rollout-batch-size {batch_size} is not divisible by dp_size {dp_size}")
        if not 0 <= timeout_s <= MAX_LEASE_S:  # also refuses NaN, which would never time out
            raise InvalidArgument(
                "timeout_seconds", f"must be 0 (the buffer's --batch-timeout-s) to {MAX_LEASE_S}, got {timeout_s}"
            )
        gids = await self._make_batch(step, timeout_s or self.config.batch_timeout_s)
        tokens, payloads, version = await self.store.batch_contents(gids)
        mine = partition(tokens, dp_size, self.config.balance_data)[dp_rank]
        chosen, payloads = [gids[i] for i in mine], [payloads[i] for i in mine]
        arrays = [] if arrays_from_redis else await self.store.arrays(chosen)
        if None in payloads or None in arrays:
            raise FailedPrecondition(f"step {step}: its groups are gone; was the step committed meanwhile?")
        return BatchPart(
            payloads, arrays, self.store.arrays_keys(chosen), sum(tokens[i] for i in mine), len(gids), version
        )

    async def _make_batch(self, step: int, timeout_s: float) -> list[str]:
        """Step `step`'s groups: its batch, made now if it has none yet (by this or another request or buffer
        process)."""
        following: list[bool] = []  # not empty once this call follows the submits
        try:
            return await self._batch(step, timeout_s, following)
        finally:
            if following:
                self._batch_waits -= 1
                if not self._batch_waits:
                    self._wanted.clear()

    async def _batch(self, step: int, timeout_s: float, following: list[bool]) -> list[str]:
        num_rollout = self.config.num_rollout
        deadline = time.monotonic() + timeout_s
        batch_size = self.config.rollout_batch_size
        while True:
            self._submitted.clear()
            made, last, top, completed = await self.store.batching(step)
            if made is not None:
                return made
            if num_rollout is not None and step >= num_rollout:
                raise FailedPrecondition(f"the run has --num-rollout {num_rollout} steps (0 to {num_rollout - 1})")
            if step <= last:
                raise FailedPrecondition(f"step {step} was already committed; ask for step {max(last, top) + 1}")
            if step > top + 1:
                raise FailedPrecondition(f"steps are handed out in order; ask for step {top + 1} before step {step}")
            eligible, stale = self._split_stale(step, completed)
            # A group too old for this step is too old for every later one.
            if await self.store.drop_completed(stale, "stale"):
                log.info(
                    "step %d: dropped %d groups past --max-staleness %d", step, len(stale), self.config.max_staleness
                )
            if len(eligible) >= batch_size:
                chosen = await self._select(step, eligible, batch_size)
                try:
                    if await self.store.record_batch(step, chosen):
                        return chosen
                except Contended:  # a chosen group went into a batch or was dropped meanwhile
                    pass
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                sizes = await self.store.sizes(TRAIN)
                raise DeadlineExceeded(
                    f"step {step}: only {len(eligible)} of {batch_size} groups were ready after {timeout_s:.0f}s "
                    f"({sizes['leased']} leased, {sizes['pending']} waiting for a worker); are rollout workers running?"
                )
            if not following:  # the submits wake it from now on; then it looks again, so that none is missed
                following.append(True)
                self._batch_waits += 1
                self._wanted.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._following.wait(), min(remaining, BATCH_POLL_S))
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._submitted.wait(), min(remaining, BATCH_POLL_S))

    def _split_stale(self, step: int, completed: list[tuple[str, int]]) -> tuple[list[str], list[str]]:
        if self.config.stale_policy == "mark":
            return [gid for gid, _ in completed], []
        oldest = step - self.config.max_staleness
        return [gid for gid, v in completed if v >= oldest], [gid for gid, v in completed if v < oldest]

    async def _select(self, step: int, eligible: list[str], batch_size: int) -> list[str]:
        if self.buffer_filter is None:
            return eligible[:batch_size]
        groups = [common_pb2.PromptGroup.FromString(p) for p in await self.store.completed_groups(eligible)]
        buffer = [list(g.samples) for g in groups]
        by_identity = {id(samples): gid for samples, gid in zip(buffer, eligible, strict=True)}
        by_first = {samples[0].sample_id: gid for samples, gid in zip(buffer, eligible, strict=True) if samples}
        chosen = self.buffer_filter(self.config, step, buffer, batch_size)
        gids = [by_identity.get(id(s)) or (by_first.get(s[0].sample_id) if s else None) for s in chosen]
        if len(gids) != batch_size or None in gids or len(set(gids)) != batch_size:
            raise FailedPrecondition(
                f"--buffer-filter-path returned {len(chosen)} groups; it must return {batch_size} distinct groups "
                "taken from the buffer it was given"
            )
        return gids

    async def commit(self, step: int) -> int:
        if step < 0:
            raise InvalidArgument("step", f"must be >= 0, got {step}")
        try:
            deleted = await self.store.commit(step)
        except Exception as e:  # the script's refusal says which step to commit instead
            if "commit step" in str(e) or "no batch" in str(e):
                raise FailedPrecondition(f"step {step}: {str(e).split(':')[-1].strip()}") from None
            raise
        return max(deleted, 0)

    async def rewind(self, step: int, version: int) -> int:
        """Back to the state a trainer resumed at `step` (policy `version`) expects: what the lost steps were trained
        on, what newer policies generated, what a reward failed to score (a resume after the reward was fixed) and
        every leased group are generated and scored again; returns how many went back."""
        if step < 0 or version < 0:
            raise InvalidArgument("step", f"step and policy_version must be >= 0, got {step} and {version}")
        # The checkpoint holds the steps before `step`: those whose commit was lost (the trainer or Redis died between
        # its save and its CommitBatch) are committed now, in order.
        last, top = await self.store.meta_int("last_committed_step", -1), await self.store.meta_int("top_step", -1)
        for covered in range(last + 1, min(step, top + 1)):
            await self.commit(covered)
        for _ in range(ATTEMPTS):
            try:
                returned = await self.store.rewind(step, version, await self._rewound_groups(step, version))
                break
            except Contended:  # another buffer process leased or batched meanwhile
                continue
        else:
            raise Unavailable("the buffer's state kept changing during the rewind; retry it")
        log.info("rewound to step %d, policy version %d: %d groups go back to the prompts", step, version, returned)
        return returned

    async def _rewound_groups(self, step: int, version: int) -> list[tuple[str, bytes]]:
        """What goes back to the prompts in a rewind, as (group id, prompt group without samples)."""
        last = await self.store.meta_int("last_committed_step", -1)
        if step <= last:
            raise FailedPrecondition(
                f"the buffer already deleted the groups of step {last} (committed), after the checkpoint's step "
                f"{step}: resume from a checkpoint of step {last + 1} or later, or start a new --run-id"
            )
        top = await self.store.meta_int("top_step", -1)
        gids = [gid for k in range(step, top + 1) for gid in await self.store.batch(k) or []]
        payloads = await self.store.completed_groups(gids)
        completed = await self.store.completed()
        stored = await self.store.completed_groups([gid for gid, _ in completed])
        for (gid, v), payload in zip(completed, stored, strict=True):
            if v > version or _reward_failed(payload):
                gids.append(gid)
                payloads.append(payload)
        leased = await self.store.leased()
        payloads += [await self.store.leased_group(gid) for gid in leased]
        back = []
        for gid, payload in zip(gids + leased, payloads, strict=True):
            group = common_pb2.PromptGroup.FromString(payload or b"")
            del group.samples[:]
            group.min_weight_version = 0
            group.timings.clear()
            back.append((gid, group.SerializeToString()))
        return back

    # Versions and state

    async def policy_version(self) -> int:
        return await self.store.meta_int("policy_version", 0)

    async def set_policy_version(self, version: int) -> int:
        current = await self.store.raise_policy_version(version)
        if version < current:
            raise FailedPrecondition(f"policy version only grows: it is {current}, got {version}")
        return version

    async def state(self) -> dict:
        counters = await self.store.counters()
        sizes = await self.store.sizes(TRAIN)
        return {
            "policy_version": await self.policy_version(),
            "num_pending_prompts": sizes["pending"],
            "num_leased_groups": sizes["leased"],
            "num_completed_groups": sizes["completed"],
            "num_filtered_groups": sum(v for k, v in counters.items() if k.startswith("dropped:")),
            "epoch": await self._epoch(),
            "num_consumed_prompts": counters.get("started", 0),
            "last_committed_step": await self.store.meta_int("last_committed_step", -1),
            "counters": counters,
            "eval_datasets": [name for name in self.streams if name != TRAIN],
        }

    async def _epoch(self) -> int:
        """The train set's epoch: the next new group's (made ahead, or where the cursor is)."""
        first = await self.store.next_ready(TRAIN)
        if first is not None and (epoch := re.match(rb"[^:]+:e(\d+):", first)):
            return int(epoch[1])
        return Cursor.decode(await self.store.cursor(TRAIN)).epoch

    async def expire_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.expire_interval_s)
            try:
                if expired := (await self.store.expire())[0]:
                    log.info("%d expired leases returned to the pool", expired)
            except Exception:  # Redis may be briefly unreachable; the next round retries
                log.exception("returning expired leases failed")

    async def follow_submits(self) -> None:
        """Wakes a GetBatch waiting for groups the moment one is completed: by this process, another buffer process
        or a worker completing it in Redis itself (the submit script publishes each). It listens only while a GetBatch
        of this process waits: every submit is published to every buffer process, and a busy one would read them all.
        While Redis is away, GetBatch still looks every BATCH_POLL_S."""
        while True:
            await self._wanted.wait()
            try:
                async with self.store.redis.pubsub(ignore_subscribe_messages=True) as pubsub:
                    await pubsub.subscribe(submitted_channel(self.store.ns))
                    self._following.set()
                    while self._wanted.is_set():
                        if await pubsub.get_message(ignore_subscribe_messages=True, timeout=FOLLOW_IDLE_S):
                            self._submitted.set()
            except RedisError as e:
                log.debug("following submits: %s; subscribing again", e)
                await asyncio.sleep(1.0)
            finally:
                self._following.clear()


def partition(tokens: list[int], num_parts: int, balance: bool) -> list[list[int]]:
    """Splits group indices into `num_parts` parts of equal size; with `balance`, the token totals are balanced
    (largest group first onto the lightest part). Each part keeps the original order."""
    size = len(tokens) // num_parts
    if not balance:
        return [list(range(i * size, (i + 1) * size)) for i in range(num_parts)]
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    loads = [0] * num_parts
    for index in sorted(range(len(tokens)), key=lambda i: -tokens[i]):
        target = min((p for p in range(num_parts) if len(parts[p]) < size), key=lambda p: loads[p])
        parts[target].append(index)
        loads[target] += tokens[index]
    return [sorted(part) for part in parts]


def _copy(group: common_pb2.PromptGroup) -> common_pb2.PromptGroup:
    copy = common_pb2.PromptGroup()
    copy.CopyFrom(group)
    return copy


def _reward_failed(payload: bytes | None) -> bool:
    """Whether a completed group has a sample whose reward failed."""
    return any(sample.HasField("reward_error") for sample in common_pb2.PromptGroup.FromString(payload or b"").samples)
