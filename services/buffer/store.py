"""The buffer's state in Redis: prompt groups, leases, completed groups, batches and counters of one run.

Every transition that touches several keys is one Lua script, so it happens whole or not at all and a crash of the
buffer process at any point leaves a state the next process can continue from. Keys live under
`<prefix>:{<run_id>}:` (the braces keep a run's keys in one Redis Cluster slot).

Group status (hash `status`): leased → pending (released or expired) → leased … → completed → batch:<step> →
trained:<step>; or dropped:<reason> (a filter or the staleness bound); eval for evaluation groups.
"""

import json

from redis.asyncio import Redis

# Prepended to every script: a group id starts with its dataset's name.
_DATASET_OF = "local function dataset_of(gid) return string.match(gid, '^([^:]*):') end\n"

_LEASE_NEW = """
local ns, field, expected, cursor, lease_ms, count_started = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local current = redis.call('HGET', ns .. ':meta', field) or ''
if current ~= expected then return redis.error_reply('cursor moved: ' .. current .. ' ~= ' .. expected) end
redis.call('HSET', ns .. ':meta', field, cursor)
local t = redis.call('TIME')
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(lease_ms)
local out = {deadline}
local i = 7
while ARGV[i] ~= '--' do
  local gid, payload = ARGV[i], ARGV[i + 1]
  local attempt = redis.call('HINCRBY', ns .. ':attempts', gid, 1)
  local lease_id = gid .. '#' .. attempt
  redis.call('SET', ns .. ':group:' .. gid, payload)
  redis.call('ZADD', ns .. ':leases', deadline, gid)
  redis.call('HSET', ns .. ':lease_id', gid, lease_id)
  redis.call('HSET', ns .. ':status', gid, 'leased')
  if count_started == '1' then redis.call('HINCRBY', ns .. ':counters', 'started', 1) end
  redis.call('HINCRBY', ns .. ':counters', 'leases', 1)
  table.insert(out, lease_id)
  i = i + 2
end
i = i + 1
while ARGV[i] do
  redis.call('HINCRBY', ns .. ':counters', 'skipped:' .. ARGV[i], tonumber(ARGV[i + 1]))
  i = i + 2
end
return out
"""

_LEASE_PENDING = """
local ns, want, lease_ms, dataset = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local t = redis.call('TIME')
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(lease_ms)
local out = {deadline}
while #out - 1 < want * 3 do
  local gid = redis.call('LPOP', ns .. ':pending:' .. dataset)
  if not gid then break end
  if redis.call('HGET', ns .. ':status', gid) == 'pending' then
    local attempt = redis.call('HINCRBY', ns .. ':attempts', gid, 1)
    local lease_id = gid .. '#' .. attempt
    redis.call('ZADD', ns .. ':leases', deadline, gid)
    redis.call('HSET', ns .. ':lease_id', gid, lease_id)
    redis.call('HSET', ns .. ':status', gid, 'leased')
    redis.call('HINCRBY', ns .. ':counters', 'leases', 1)
    table.insert(out, gid)
    table.insert(out, lease_id)
    table.insert(out, redis.call('GET', ns .. ':group:' .. gid))
  end
end
return out
"""

_EXTEND = """
local ns, lease_ms = ARGV[1], ARGV[2]
local t = redis.call('TIME')
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(lease_ms)
local out = {deadline}
for i = 3, #ARGV do
  local lease_id = ARGV[i]
  local gid = string.match(lease_id, '^(.*)#%d+$')
  local ok = gid and redis.call('HGET', ns .. ':lease_id', gid) == lease_id
    and redis.call('HGET', ns .. ':status', gid) == 'leased'
  if ok then redis.call('ZADD', ns .. ':leases', deadline, gid) end
  table.insert(out, ok and 1 or 0)
end
return out
"""

_RELEASE = """
local ns, lease_id, payload = ARGV[1], ARGV[2], ARGV[3]
local gid = string.match(lease_id, '^(.*)#%d+$')
if not gid or redis.call('HGET', ns .. ':lease_id', gid) ~= lease_id
   or redis.call('HGET', ns .. ':status', gid) ~= 'leased' then
  return 0
end
redis.call('ZREM', ns .. ':leases', gid)
if payload ~= '' then redis.call('SET', ns .. ':group:' .. gid, payload) end
redis.call('HSET', ns .. ':status', gid, 'pending')
redis.call('LPUSH', ns .. ':pending:' .. dataset_of(gid), gid)
redis.call('HINCRBY', ns .. ':counters', 'released', 1)
return 1
"""

_EXPIRE = """
local ns = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gids = redis.call('ZRANGEBYSCORE', ns .. ':leases', '-inf', now)
for _, gid in ipairs(gids) do
  redis.call('ZREM', ns .. ':leases', gid)
  redis.call('HSET', ns .. ':status', gid, 'pending')
  redis.call('LPUSH', ns .. ':pending:' .. dataset_of(gid), gid)
  redis.call('HINCRBY', ns .. ':counters', 'expired', 1)
end
return #gids
"""

# ARGV: ns, lease id, outcome ("completed" | "dropped:<reason>" | "eval:<dataset>"), payload, min version, tokens
_SUBMIT = """
local ns, lease_id, outcome, payload, version, tokens = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local gid = string.match(lease_id, '^(.*)#%d+$')
if not gid then return 'unknown' end
local status = redis.call('HGET', ns .. ':status', gid)
if not status then return 'unknown' end
if status ~= 'leased' and status ~= 'pending' then
  redis.call('HINCRBY', ns .. ':counters', 'duplicate_submits', 1)
  return 'duplicate'
end
redis.call('ZREM', ns .. ':leases', gid)
if status == 'pending' then redis.call('LREM', ns .. ':pending:' .. dataset_of(gid), 0, gid) end
redis.call('DEL', ns .. ':group:' .. gid)
redis.call('HSET', ns .. ':status', gid, outcome)
if outcome == 'completed' then
  local seq = redis.call('HINCRBY', ns .. ':counters', 'completed', 1)
  redis.call('SET', ns .. ':done:' .. gid, payload)
  redis.call('ZADD', ns .. ':done', seq, gid)
  redis.call('HSET', ns .. ':done_version', gid, version)
  redis.call('HSET', ns .. ':done_tokens', gid, tokens)
elseif string.sub(outcome, 1, 5) == 'eval:' then
  redis.call('HSET', ns .. ':' .. outcome, gid, payload)
  redis.call('HINCRBY', ns .. ':counters', 'eval_completed', 1)
else
  redis.call('HINCRBY', ns .. ':counters', 'dropped', 1)
  redis.call('HINCRBY', ns .. ':counters', outcome, 1)
end
return 'accepted'
"""

# ARGV: ns, step, chosen gids...
_RECORD_BATCH = """
local ns, step, n = ARGV[1], ARGV[2], #ARGV - 2
local last = tonumber(redis.call('HGET', ns .. ':meta', 'last_committed_step') or '-1')
if tonumber(step) <= last then return redis.error_reply('step ' .. step .. ' was already committed') end
if redis.call('EXISTS', ns .. ':batch:' .. step) == 1 then return 0 end
-- Check before writing: an error after a write would leave the write in place.
for i = 3, 2 + n do
  if not redis.call('ZSCORE', ns .. ':done', ARGV[i]) then return redis.error_reply(ARGV[i] .. ' is not completed') end
end
local chosen = {}
for i = 3, 2 + n do
  local gid = ARGV[i]
  redis.call('ZREM', ns .. ':done', gid)
  redis.call('HSET', ns .. ':status', gid, 'batch:' .. step)
  table.insert(chosen, gid)
end
redis.call('SET', ns .. ':batch:' .. step, cjson.encode(chosen))
local top = tonumber(redis.call('HGET', ns .. ':meta', 'top_step') or '-1')
if tonumber(step) > top then redis.call('HSET', ns .. ':meta', 'top_step', step) end
return 1
"""

_DROP = """
local ns, reason = ARGV[1], ARGV[2]
local dropped = 0
for i = 3, #ARGV do
  local gid = ARGV[i]
  if redis.call('ZREM', ns .. ':done', gid) == 1 then
    redis.call('DEL', ns .. ':done:' .. gid)
    redis.call('HDEL', ns .. ':done_version', gid)
    redis.call('HDEL', ns .. ':done_tokens', gid)
    redis.call('HSET', ns .. ':status', gid, 'dropped:' .. reason)
    redis.call('HINCRBY', ns .. ':counters', 'dropped', 1)
    redis.call('HINCRBY', ns .. ':counters', 'dropped:' .. reason, 1)
    dropped = dropped + 1
  end
end
return dropped
"""

_COMMIT = """
local ns, step = ARGV[1], ARGV[2]
local last = tonumber(redis.call('HGET', ns .. ':meta', 'last_committed_step') or '-1')
if tonumber(step) <= last then return -1 end
if tonumber(step) ~= last + 1 then return redis.error_reply('commit step ' .. (last + 1) .. ' first') end
local record = redis.call('GET', ns .. ':batch:' .. step)
if not record then return redis.error_reply('no batch was handed out for step ' .. step) end
local gids = cjson.decode(record)
for _, gid in ipairs(gids) do
  redis.call('DEL', ns .. ':done:' .. gid)
  redis.call('HDEL', ns .. ':done_version', gid)
  redis.call('HDEL', ns .. ':done_tokens', gid)
  redis.call('HSET', ns .. ':status', gid, 'trained:' .. step)
end
redis.call('DEL', ns .. ':batch:' .. step)
redis.call('HSET', ns .. ':meta', 'last_committed_step', step)
redis.call('HINCRBY', ns .. ':counters', 'trained', #gids)
return #gids
"""

# ARGV: ns, step, version, then (gid, prompt payload) pairs of the groups that go back
_REWIND = """
local ns, step, version = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local last = tonumber(redis.call('HGET', ns .. ':meta', 'last_committed_step') or '-1')
if step <= last then return redis.error_reply('step ' .. last .. ' was already committed') end
local top = tonumber(redis.call('HGET', ns .. ':meta', 'top_step') or '-1')
for k = step, top do redis.call('DEL', ns .. ':batch:' .. k) end
if top >= step then redis.call('HSET', ns .. ':meta', 'top_step', step - 1) end
local back = 0
for i = #ARGV - 1, 4, -2 do  -- backwards, so that LPUSH leaves them in their order
  local gid, payload = ARGV[i], ARGV[i + 1]
  redis.call('ZREM', ns .. ':done', gid)
  redis.call('ZREM', ns .. ':leases', gid)
  redis.call('DEL', ns .. ':done:' .. gid)
  redis.call('HDEL', ns .. ':done_version', gid)
  redis.call('HDEL', ns .. ':done_tokens', gid)
  redis.call('SET', ns .. ':group:' .. gid, payload)
  redis.call('HSET', ns .. ':status', gid, 'pending')
  redis.call('LPUSH', ns .. ':pending:' .. dataset_of(gid), gid)
  back = back + 1
end
redis.call('HSET', ns .. ':meta', 'policy_version', version)
redis.call('HINCRBY', ns .. ':counters', 'rewound', back)
return back
"""


class BufferStore:
    """Typed access to one run's keys; every multi-key change is one atomic script."""

    def __init__(self, redis: Redis, prefix: str, run_id: str):
        self.redis = redis
        self.ns = f"{prefix}:{{{run_id}}}"
        self._scripts = {
            name: redis.register_script(_DATASET_OF + code)
            for name, code in [
                ("lease_new", _LEASE_NEW),
                ("lease_pending", _LEASE_PENDING),
                ("extend", _EXTEND),
                ("release", _RELEASE),
                ("expire", _EXPIRE),
                ("submit", _SUBMIT),
                ("record_batch", _RECORD_BATCH),
                ("drop", _DROP),
                ("commit", _COMMIT),
                ("rewind", _REWIND),
            ]
        }

    def key(self, name: str) -> str:
        return f"{self.ns}:{name}"

    async def _run(self, script: str, *args) -> object:
        return await self._scripts[script](keys=[self.key("meta")], args=[self.ns, *args])

    async def cursor(self, dataset: str) -> bytes | None:
        return await self.redis.hget(self.key("meta"), f"cursor:{dataset}")

    async def lease_new(
        self,
        dataset: str,
        expected: str,
        cursor: str,
        lease_ms: int,
        groups: list[tuple[str, bytes]],
        skipped: dict[str, int],
        count_started: bool,
    ) -> tuple[int, list[str]]:
        """Stores new groups as leased and moves the dataset cursor; returns (deadline ms, lease ids)."""
        args = [f"cursor:{dataset}", expected, cursor, lease_ms, int(count_started)]
        for gid, payload in groups:
            args += [gid, payload]
        args.append("--")
        for reason, count in skipped.items():
            args += [reason, count]
        deadline, *lease_ids = await self._run("lease_new", *args)
        return int(deadline), [lid.decode() for lid in lease_ids]

    async def lease_pending(self, dataset: str, want: int, lease_ms: int) -> tuple[int, list[tuple[str, str, bytes]]]:
        """Leases up to `want` returned groups (released or expired) of `dataset`, latest returned first."""
        deadline, *flat = await self._run("lease_pending", want, lease_ms, dataset)
        leased = [(flat[i].decode(), flat[i + 1].decode(), flat[i + 2]) for i in range(0, len(flat), 3)]
        return int(deadline), leased

    async def extend(self, lease_ids: list[str], lease_ms: int) -> tuple[int, list[bool]]:
        deadline, *flags = await self._run("extend", lease_ms, *lease_ids)
        return int(deadline), [bool(flag) for flag in flags]

    async def release(self, lease_id: str, payload: bytes) -> bool:
        return bool(await self._run("release", lease_id, payload))

    async def expire(self) -> int:
        return int(await self._run("expire"))

    async def submit(self, lease_id: str, outcome: str, payload: bytes, version: int, num_tokens: int) -> str:
        return (await self._run("submit", lease_id, outcome, payload, version, num_tokens)).decode()

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

    async def num_tokens(self, gids: list[str]) -> list[int]:
        """Token counts of completed groups (stored at submit, so batches are balanced without reading groups)."""
        return [int(n or 0) for n in await self.redis.hmget(self.key("done_tokens"), gids)] if gids else []

    async def completed_groups(self, gids: list[str]) -> list[bytes]:
        if not gids:
            return []
        return await self.redis.mget([self.key(f"done:{gid}") for gid in gids])

    async def record_batch(self, step: int, chosen: list[str]) -> None:
        await self._run("record_batch", step, *chosen)

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

    async def set_meta(self, field: str, value: int) -> None:
        await self.redis.hset(self.key("meta"), field, value)

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
        status = {k.decode(): v.decode() for k, v in (await self.redis.hgetall(self.key("status"))).items()}
        leased, done = set(await self.leased()), {gid for gid, _ in await self.completed()}
        problems = [f"{gid} has a lease but status {status.get(gid)}" for gid in leased if status.get(gid) != "leased"]
        problems += [f"{gid} is leased without a lease" for gid, s in status.items()
                     if s == "leased" and gid not in leased]  # fmt: skip
        problems += [f"{gid} waits for a batch with status {status.get(gid)}" for gid in done
                     if status.get(gid) != "completed"]  # fmt: skip
        for gid, s in status.items():
            if s == "completed" and (gid not in done or not await self.redis.exists(self.key(f"done:{gid}"))):
                problems.append(f"{gid} is completed but not waiting for a batch with its samples")
            if s.startswith("batch:") and gid not in (await self.batch(int(s[6:])) or []):
                problems.append(f"{gid} has status {s} but is not in that step's batch")
            if s.startswith(("trained:", "dropped:")) and await self.redis.exists(self.key(f"done:{gid}")):
                problems.append(f"{gid} is {s} but its samples are still stored")
        return problems
