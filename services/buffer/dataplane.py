"""The buffer's data plane: the part of the buffer's Redis layout that other services use, declared and versioned.
A gateway completes its training groups here (the submit script) or uploads their arrays; a trainer reads the arrays
by the keys GetBatch hands out. This module is the only buffer code other services import (docs/buffer.md, "The
data plane").

The buffer writes LAYOUT_VERSION into the run's keys when it starts; a service checks it the first time it uses a
run's keys and stops on another version. A change to these keys, to what their values hold or to the submit
transition (lua/submit_functions.lua) is a new LAYOUT_VERSION.
"""

from dataclasses import dataclass
from importlib.resources import files

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import NoScriptError

from services.buffer.groups import check_group, leased_group_id, min_version, num_tokens
from services.common.errors import FailedPrecondition, NotFound, StartupError
from slipstream import samples
from slipstream.v1 import buffer_pb2, common_pb2

LAYOUT_VERSION = 2  # 2: new groups wait in a ready list
UPLOAD_TTL_S = 3600  # an upload not taken over by a submit (its worker died in between) is gone after an hour
INLINE_ARRAYS = 64 * 1024  # a worker's arrays up to this size go in its submit script's call, larger ones uploaded


def namespace(prefix: str, run_id: str) -> str:
    """A run's keys are under `<prefix>:{<run_id>}`: the braces keep them in one Redis Cluster slot."""
    return f"{prefix}:{{{run_id}}}"


def namespace_of(key: str) -> str:
    """The run's namespace of one of its keys: up to the end of its hash tag (the first `{...}`, as Redis reads it)."""
    return key[: key.index("}", key.index("{")) + 1]


def layout_key(ns: str) -> str:
    return f"{ns}:layout"


def upload_key(ns: str, lease_id: str) -> str:
    """Where a worker may write a group's arrays before its submit (expires after UPLOAD_TTL_S)."""
    return f"{ns}:upload:{lease_id}"


def arrays_key(ns: str, group_id: str) -> str:
    """A completed group's samples' arrays (samples.take_arrays' form), until its batch is committed or dropped."""
    return f"{ns}:arrays:{group_id}"


def completed_key(ns: str, group_id: str) -> str:
    """A completed group without its samples' arrays (a serialized PromptGroup)."""
    return f"{ns}:done:{group_id}"


def waiting_key(ns: str) -> str:
    """The completed groups waiting for a batch (a sorted set, scored by the order they were completed in)."""
    return f"{ns}:done"


def counters_key(ns: str) -> str:
    """The run's counters (a hash: started, completed, dropped:<reason>, ...; docs/buffer.md, "State")."""
    return f"{ns}:counters"


def submitted_channel(ns: str) -> str:
    """Where the submit script announces completed groups (the buffer follows it while a GetBatch waits)."""
    return f"{ns}:submitted"


class LayoutMismatch(StartupError):
    """The run's keys in Redis hold another data-plane layout than this slipstream's."""


def check_layout(ns: str, found: bytes | None) -> None:
    """Raises LayoutMismatch unless `found`, the value of the run's layout key, is this slipstream's LAYOUT_VERSION."""
    if found == str(LAYOUT_VERSION).encode():
        return
    if found is None:
        raise LayoutMismatch(
            f"Redis holds no data-plane layout under {ns} and this slipstream reads layout {LAYOUT_VERSION}: "
            "point --redis-url at the buffer's Redis and run the buffer from the same slipstream version"
        )
    raise LayoutMismatch(
        f"the buffer's Redis holds data-plane layout {found.decode(errors='replace')} under {ns} and this slipstream "
        f"reads layout {LAYOUT_VERSION}: run the buffer, the gateways and the trainer from the same slipstream version"
    )


def lua(name: str) -> str:
    """services/buffer/lua/<name>.lua: the buffer's Redis scripts are files of their own, read and linted as Lua
    (pyproject.toml ships them with the package)."""
    return (files("services.buffer") / "lua" / f"{name}.lua").read_text()


SUBMIT_FUNCTIONS = lua("submit_functions")  # the submit transition, put before every script that completes groups
_SUBMIT_MANY = lua("submit_many")


@dataclass
class Completion:
    """A training group a worker completes itself (DataPlane.complete)."""

    lease_id: str
    arrays: bytes  # its samples' arrays (samples.take_arrays' form)
    payload: bytes  # the group without them
    version: int  # the oldest weight version of its samples
    num_tokens: int


class DataPlane:
    """One run's data-plane keys in the buffer's Redis, as a gateway uses them (the buffer's store builds on it)."""

    def __init__(self, redis: Redis, ns: str):
        """`ns`: the run's namespace, `<prefix>:{<run_id>}` (a lease's submit_namespace)."""
        self.redis, self.ns = redis, ns
        self._submit_many = redis.register_script(SUBMIT_FUNCTIONS + _SUBMIT_MANY)

    def key(self, name: str) -> str:
        return f"{self.ns}:{name}"

    def upload_key(self, lease_id: str) -> str:
        return upload_key(self.ns, lease_id)

    def arrays_keys(self, gids: list[str]) -> list[str]:
        return [arrays_key(self.ns, gid) for gid in gids]

    async def check_layout(self) -> None:
        """Raises LayoutMismatch unless the run's keys hold this slipstream's layout."""
        check_layout(self.ns, await self.redis.get(layout_key(self.ns)))

    async def complete(self, groups: list[Completion]) -> list[str]:
        """A worker's own submit of training groups (no dynamic-sampling filter), in one round trip: arrays up to
        INLINE_ARRAYS bytes go in the script's call, larger ones to their lease's upload key first, pipelined on one
        connection (Redis runs them in order, so the script finds them: a script's arguments are copied, megabytes
        are cheaper renamed into place). Answers each as the buffer's submit ('accepted', 'duplicate', 'unknown')."""
        args, uploads, seen = [self.ns], [], set()
        for group in groups:
            # A lease named again in the call is answered as the first (a duplicate) and must not overwrite its upload.
            again = group.lease_id in seen
            seen.add(group.lease_id)
            upload = not again and len(group.arrays) > INLINE_ARRAYS
            uploads += [group] if upload else []
            arrays = b"" if upload or again else group.arrays
            args += [group.lease_id, group.payload, group.version, group.num_tokens, arrays, int(upload)]
        script = self._submit_many
        if isinstance(self.redis, RedisCluster):  # its pipelines carry no scripts: the uploads first, then the script
            if uploads:
                async with self.redis.pipeline(transaction=False) as pipe:
                    for group in uploads:
                        pipe.set(self.upload_key(group.lease_id), group.arrays, ex=UPLOAD_TTL_S)
                    await pipe.execute()
            return [result.decode() for result in await script(keys=[self.key("meta")], args=args)]
        # The script is loaded on the first NOSCRIPT (a new or restarted Redis), then sent again: redis-py's Script in
        # a pipeline would ask SCRIPT EXISTS first, a round trip more on every submit.
        for _ in range(2):
            async with self.redis.pipeline(transaction=False) as pipe:
                for group in uploads:
                    pipe.set(self.upload_key(group.lease_id), group.arrays, ex=UPLOAD_TTL_S)
                pipe.evalsha(script.sha, 1, self.key("meta"), *args)
                *uploaded, results = await pipe.execute(raise_on_error=False)
            if not isinstance(results, NoScriptError):
                break
            await self.redis.script_load(script.script)
        for answer in (*uploaded, results):
            if isinstance(answer, Exception):
                raise answer
        return [result.decode() for result in results]


def completion(lease: buffer_pb2.Lease, group: common_pb2.PromptGroup) -> Completion:
    """A finished training group as a worker completes it in Redis itself, checked as SubmitGroup checks it. Takes
    the arrays out of `group`."""
    group_id = leased_group_id(lease.lease_id)
    arrays, sizes = samples.take_sized_arrays(group)  # checked once taken out: each array is copied once
    check_group(group, group.n_samples or None, arrays_in_redis=False, sizes=sizes)
    group.group_id, group.min_weight_version = group_id, min_version(group)
    return Completion(lease.lease_id, arrays, group.SerializeToString(), group.min_weight_version, num_tokens(group))


def completed_now(plane: DataPlane, lease_id: str, result: str) -> bool:
    """What the submit script answered for a worker's group: True when the group was completed now, False when it had
    been already; raises for an unknown lease or a refusal."""
    if result == "unknown":
        raise NotFound(f"lease {lease_id!r} is unknown to the run under {plane.ns!r}")
    if result not in ("accepted", "duplicate"):
        raise FailedPrecondition(f"the buffer's submit of lease {lease_id!r} answered {result!r}")
    return result == "accepted"


async def complete_in_redis(plane: DataPlane, lease: buffer_pb2.Lease, group: common_pb2.PromptGroup) -> bool:
    """A worker's submit of a finished training group without the buffer in between: checked as SubmitGroup checks
    it, then its arrays and the buffer's submit transition in one round trip to Redis (DataPlane.complete). The lease
    must have a `submit_namespace` (the buffer runs no dynamic-sampling filter, which needs the group). Takes the
    arrays out of `group`. True when the group was completed now, False when it had been already. A gateway completes
    the groups finished together in one call (services/rollout/submits.py)."""
    (result,) = await plane.complete([completion(lease, group)])
    return completed_now(plane, lease.lease_id, result)
