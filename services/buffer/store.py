"""The buffer's state in Redis: prompt groups, leases, completed groups, batches and counters of one run.

Every transition that touches several keys is one Lua script, so it happens whole or not at all and a crash of the
buffer process at any point leaves a state the next process can continue from. The scripts also check the bounds
they rely on (the dataset cursor a read-ahead started from, the room under the backpressure cap and the staleness bound,
which steps have a batch), so any number of buffer processes on one Redis give the guarantees of one: a script that
finds the state moved under it refuses (`Contended`) and its caller looks again. Keys live under
`<prefix>:{<run_id>}:` (the braces keep a run's keys in one Redis Cluster slot). A completed group is stored in two
parts: `done:<gid>` without its samples' arrays (what the buffer reads) and `arrays:<gid>` (the bulk, which a trainer
with Redis access reads itself); a worker may upload the arrays to `upload:<lease id>` before it submits.

A new group is made ahead into its dataset's ready list (`ready:<dataset>`, no status yet) and gets a status with its
first lease. Group status (hash `status`): leased → pending (released or expired) → leased … → completed →
batch:<step> → trained:<step>; or dropped:<reason> (a filter or the staleness bound); eval for evaluation groups.
"""

import json
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.lock import Lock
from redis.exceptions import ResponseError

from services.buffer.dataplane import (
    LAYOUT_VERSION,
    SUBMIT_FUNCTIONS,
    DataPlane,
    check_layout,
    layout_key,
    lua,
    namespace,
)

# The buffer's own scripts (lua/<name>.lua, each saying what it takes and answers), each run after the submit
# transition and the functions they share.
_SHARED = SUBMIT_FUNCTIONS + lua("store_functions")
_SCRIPTS = {
    name: _SHARED + lua(name)
    for name in ("stage", "lease_start", "extend", "release", "expire", "submit", "record_batch", "drop", "commit",
                 "rewind", "raise_version", "snapshot")
}  # fmt: skip


@dataclass
class LeaseStart:
    expired: int
    policy_version: int
    deadline_ms: int  # of the groups leased
    counters: dict[str, int]  # started and dropped
    sizes: dict[str, int]  # pending, leased, completed, ready
    leased: list[tuple[str, str, bytes]]  # (group id, lease id, payload) of the groups leased


class Contended(Exception):
    """The state a transition was computed from moved under it (another buffer process): look again and retry."""


class BufferStore(DataPlane):
    """Typed access to one run's keys; every multi-key change is one atomic script. The data plane's keys and the
    workers' submit are DataPlane's; the rest is the buffer's own."""

    def __init__(self, redis: Redis, prefix: str, run_id: str | None = None):
        """The run's keys are under `<prefix>:{<run_id>}`; without `run_id`, `prefix` is that namespace (a lease's
        submit_namespace)."""
        super().__init__(redis, prefix if run_id is None else namespace(prefix, run_id))
        self._scripts = {name: redis.register_script(code) for name, code in _SCRIPTS.items()}

    async def declare_layout(self) -> None:
        """Writes the data plane's layout version into a new run's keys; in a run's that has one, checks it (a buffer
        of another layout must not continue the run)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(layout_key(self.ns), LAYOUT_VERSION, nx=True).get(layout_key(self.ns))
            _, found = await pipe.execute()
        check_layout(self.ns, found)

    async def _run(self, script: str, *args) -> object:
        try:
            return await self._scripts[script](keys=[self.key("meta")], args=[self.ns, *args])
        except ResponseError as e:
            if "CONTENDED" in str(e):
                raise Contended(str(e).split("CONTENDED", 1)[1].strip()) from None
            raise

    async def cursor(self, dataset: str) -> bytes | None:
        return await self.redis.hget(self.key("meta"), f"cursor:{dataset}")

    async def stage_state(self, dataset: str) -> tuple[bytes | None, int]:
        """The dataset's cursor and how many new groups wait in its ready list, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hget(self.key("meta"), f"cursor:{dataset}").llen(self.key(f"ready:{dataset}"))
            cursor, ready = await pipe.execute()
        return cursor, ready

    async def next_ready(self, dataset: str) -> bytes | None:
        """The id of the new group the next lease takes, if one was made ahead."""
        return await self.redis.lindex(self.key(f"ready:{dataset}"), 0)

    def reading_lock(self, dataset: str) -> Lock:
        """Held by the buffer process that reads the dataset ahead (released by it, or expired after a minute; a
        release after the expiry is quiet). A holder waits up to 10 s, polling every 5 ms."""
        return self.redis.lock(
            self.key(f"reading:{dataset}"), timeout=60, sleep=0.005, blocking_timeout=10,
            thread_local=False, raise_on_release_error=False,
        )  # fmt: skip

    async def stage(
        self, dataset: str, expected: str, cursor: str, groups: list[tuple[str, bytes]], skipped: dict[str, int]
    ) -> int:
        """Appends new groups to the dataset's ready list and moves its cursor from `expected` (`Contended` when
        another buffer process moved it); returns the ready list's length."""
        args = [dataset, expected, cursor]
        for gid, payload in groups:
            args += [gid, payload]
        args.append("--")
        for reason, count in skipped.items():
            args += [reason, count]
        return int(await self._run("stage", *args))

    async def lease_start(
        self,
        dataset: str,
        want: int,
        lease_ms: int,
        cap: int = -1,
        limit: tuple[int, int, int] = (-1, 0, -1),
        count_started: bool = False,
    ) -> "LeaseStart":
        """A lease in one round trip: returns expired leases' groups to the pool, leases up to `want` groups of
        `dataset` that the bounds allow, returned ones first (latest returned first), then new ones from the ready
        list, and reads what the bounds are computed from. `limit`: (per_version, base, fixed), the bound on live
        groups at policy version v being min(v * per_version + base, fixed), -1 for none (the policy version is read
        after expiry, in the script)."""
        reply = await self._run("lease_start", dataset, want, lease_ms, cap, *limit, int(count_started))
        expired, version, deadline, started, dropped, pending, leased, completed, ready, *flat = reply
        groups = [(flat[i].decode(), flat[i + 1].decode(), flat[i + 2]) for i in range(0, len(flat), 3)]
        counters = {"started": int(started), "dropped": int(dropped)}
        sizes = {"pending": int(pending), "leased": int(leased), "completed": int(completed), "ready": int(ready)}
        return LeaseStart(int(expired), int(version), int(deadline), counters, sizes, groups)

    async def extend(self, lease_ids: list[str], lease_ms: int) -> tuple[int, list[bool]]:
        deadline, *flags = await self._run("extend", lease_ms, *lease_ids)
        return int(deadline), [bool(flag) for flag in flags]

    async def release(self, lease_id: str, payload: bytes) -> bool:
        return bool(await self._run("release", lease_id, payload))

    async def expire(self) -> tuple[int, int]:
        """Returns the expired leases' groups to the pool; (how many, the policy version), in one round trip."""
        expired, version = await self._run("expire")
        return int(expired), int(version)

    async def submit(
        self, lease_id: str, outcome: str, payload: bytes, version: int, num_tokens: int, arrays: bytes | None
    ) -> str:
        """Stores a finished group: `payload` without its samples' arrays, and `arrays`, or (None) the arrays the
        worker uploaded for this lease. 'accepted', 'duplicate', 'unknown', or 'no_arrays' when none were uploaded."""
        uploaded = arrays is None
        args = [lease_id, outcome, payload, version, num_tokens, b"" if uploaded else arrays, int(uploaded)]
        return (await self._run("submit", *args)).decode()

    async def leased_group(self, group_id: str) -> bytes | None:
        """The stored prompt group (with its partial samples) of a group that is leased or waiting for a worker."""
        return await self.redis.get(self.key(f"group:{group_id}"))

    async def status(self, group_id: str) -> str | None:
        value = await self.redis.hget(self.key("status"), group_id)
        return value.decode() if value is not None else None

    async def completed(self) -> list[tuple[str, int]]:
        """Completed groups not yet in a batch, oldest first, with their weight version."""
        gids = [gid.decode() for gid in await self.redis.zrange(self.key("done"), 0, -1)]
        if not gids:
            return []
        versions = await self.redis.hmget(self.key("done_version"), gids)
        return [(gid, int(v or 0)) for gid, v in zip(gids, versions, strict=True)]

    async def batching(self, step: int) -> tuple[list[str] | None, int, int, list[tuple[str, int]]]:
        """What a batch for `step` is made from, in one round trip: the step's batch if it has one already, the last
        committed step and the top step handed out (-1: none), and the completed groups (as `completed`)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(self.key(f"batch:{step}")).hmget(self.key("meta"), "last_committed_step", "top_step")
            pipe.zrange(self.key("done"), 0, -1).hgetall(self.key("done_version"))
            record, (last, top), gids, versions = await pipe.execute()
        completed = [(gid.decode(), int(versions.get(gid) or 0)) for gid in gids]
        made = json.loads(record) if record is not None else None
        return made, int(last if last is not None else -1), int(top if top is not None else -1), completed

    async def batch_contents(self, gids: list[str]) -> tuple[list[int], list[bytes | None], int]:
        """A batch's groups' token counts (stored at submit, so batches are balanced without reading groups) and
        payloads, and the policy version, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:  # GETs: a Redis Cluster's pipelines take no MGET
            pipe.hmget(self.key("done_tokens"), gids).hget(self.key("meta"), "policy_version")
            for gid in gids:
                pipe.get(self.key(f"done:{gid}"))
            tokens, version, *payloads = await pipe.execute()
        return [int(n or 0) for n in tokens], payloads, int(version or 0)

    async def completed_groups(self, gids: list[str]) -> list[bytes]:
        if not gids:
            return []
        return await self.redis.mget([self.key(f"done:{gid}") for gid in gids])

    async def arrays(self, gids: list[str]) -> list[bytes | None]:
        """The samples' arrays of completed groups (samples.take_arrays' form)."""
        return await self.redis.mget(self.arrays_keys(gids)) if gids else []

    async def record_batch(self, step: int, chosen: list[str]) -> bool:
        """Records step `step`'s groups; False when the step had a batch already."""
        return bool(await self._run("record_batch", step, *chosen))

    async def drop_completed(self, gids: list[str], reason: str) -> int:
        """Drops completed groups that can no longer be trained, counting them under dropped:<reason>."""
        return int(await self._run("drop", reason, *gids)) if gids else 0

    async def batch(self, step: int) -> list[str] | None:
        record = await self.redis.get(self.key(f"batch:{step}"))
        return json.loads(record) if record is not None else None

    async def commit(self, step: int) -> int:
        """Deletes what step `step` consumed; -1 if it was committed before."""
        return int(await self._run("commit", step))

    async def rewind(self, step: int, version: int, groups: list[tuple[str, bytes]]) -> int:
        """Drops the batches of `step` and later, puts `groups` back as pending with the given payloads and sets the
        policy version, in one transition."""
        return int(await self._run("rewind", step, version, *(x for pair in groups for x in pair)))

    async def leased(self) -> list[str]:
        return [gid.decode() for gid in await self.redis.zrange(self.key("leases"), 0, -1)]

    async def meta_int(self, field: str, default: int) -> int:
        value = await self.redis.hget(self.key("meta"), field)
        return int(value) if value is not None else default

    async def raise_policy_version(self, version: int) -> int:
        """Sets the policy version if `version` is higher; returns the version now."""
        return int(await self._run("raise_version", version))

    async def counters(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in (await self.redis.hgetall(self.key("counters"))).items()}

    async def sizes(self, dataset: str) -> dict[str, int]:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.llen(self.key(f"pending:{dataset}")).zcard(self.key("leases")).zcard(self.key("done"))
            pending, leased, completed = await pipe.execute()
        return {"pending": pending, "leased": leased, "completed": completed}

    async def violations(self) -> list[str]:
        """What breaks the buffer's invariants in Redis (empty when none): each group's status agrees with the sets
        it is in (a leased group has a lease, a completed one is waiting with its payload, a batched one is in its
        step's batch), and no trained or dropped group keeps its samples. The fuzz and fault tests check it."""
        pairs, leases, completed = await self._run("snapshot")  # at one instant: other replicas may be changing them
        status = {k.decode(): v.decode() for k, v in zip(pairs[::2], pairs[1::2], strict=True)}
        leased, done = {gid.decode() for gid in leases}, {gid.decode() for gid in completed}
        problems = [f"{gid} has a lease but status {status.get(gid)}" for gid in leased if status.get(gid) != "leased"]
        problems += [
            f"{gid} is leased without a lease" for gid, s in status.items() if s == "leased" and gid not in leased
        ]
        problems += [
            f"{gid} waits for a batch with status {status.get(gid)}" for gid in done if status.get(gid) != "completed"
        ]
        for gid, s in status.items():
            stored = await self.redis.exists(self.key(f"done:{gid}"), self.key(f"arrays:{gid}"))
            if s == "completed" and (gid not in done or stored != 2):
                problems.append(f"{gid} is completed but not waiting for a batch with its samples")
            if s.startswith("batch:") and gid not in (await self.batch(int(s[6:])) or []):
                problems.append(f"{gid} has status {s} but is not in that step's batch")
            if s.startswith(("trained:", "dropped:")) and stored:
                problems.append(f"{gid} is {s} but its samples are still stored")
        return problems
