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

from services.buffer.dataplane import LAYOUT_VERSION, SUBMIT_FUNCTIONS, DataPlane, check_layout, layout_key, namespace

# Prepended to every script, after the submit transition (dataplane.SUBMIT_FUNCTIONS): how many more groups the bounds
# allow (cap: leased plus completed groups, -1 for none; limit: live training groups, started minus dropped, -1 for
# none).
_PRELUDE = """
local function room(ns, cap, limit)
  local free = 1073741824
  if tonumber(cap) >= 0 then
    free = tonumber(cap) - redis.call('ZCARD', ns .. ':leases') - redis.call('ZCARD', ns .. ':done')
  end
  if tonumber(limit) >= 0 then
    local c = redis.call('HMGET', ns .. ':counters', 'started', 'dropped')
    free = math.min(free, tonumber(limit) - (tonumber(c[1] or '0') - tonumber(c[2] or '0')))
  end
  return free
end
-- Returns the expired leases' groups to the pool; (how many, the policy version).
local function expire(ns)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local gids = redis.call('ZRANGEBYSCORE', ns .. ':leases', '-inf', now)
  for _, gid in ipairs(gids) do
    redis.call('ZREM', ns .. ':leases', gid)
    redis.call('HSET', ns .. ':status', gid, 'pending')
    redis.call('LPUSH', ns .. ':pending:' .. dataset_of(gid), gid)
    redis.call('HINCRBY', ns .. ':counters', 'expired', 1)
  end
  return #gids, tonumber(redis.call('HGET', ns .. ':meta', 'policy_version') or '0')
end
local function deadline_in(lease_ms)
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(lease_ms)
end
-- Leases up to `want` returned groups of `dataset` that the bounds allow (groups sent back are live already: under
-- the staleness bound they count as room); (deadline, {gid, lease id, payload, ...}).
local function lease_pending(ns, dataset, want, lease_ms, cap, limit)
  local pending = ns .. ':pending:' .. dataset
  want = math.min(want, room(ns, cap, -1), room(ns, -1, limit) + redis.call('LLEN', pending))
  local deadline, out = deadline_in(lease_ms), {}
  while #out < want * 3 do
    local gid = redis.call('LPOP', pending)
    if not gid then break end
    if redis.call('HGET', ns .. ':status', gid) == 'pending' then
      local lease_id = gid .. '#' .. redis.call('HINCRBY', ns .. ':attempts', gid, 1)
      redis.call('ZADD', ns .. ':leases', deadline, gid)
      redis.call('HSET', ns .. ':lease_id', gid, lease_id)
      redis.call('HSET', ns .. ':status', gid, 'leased')
      redis.call('HINCRBY', ns .. ':counters', 'leases', 1)
      table.insert(out, gid)
      table.insert(out, lease_id)
      table.insert(out, redis.call('GET', ns .. ':group:' .. gid))
    end
  end
  return deadline, out
end
-- `command` over (key and) `args` in parts: Lua's unpack takes a few thousand values at most. Parts are of an even
-- size, so pairs stay together.
local function call_in_parts(command, key, args)
  for first = 1, #args, 1000 do
    local part = {unpack(args, first, math.min(first + 999, #args))}
    if key then redis.call(command, key, unpack(part)) else redis.call(command, unpack(part)) end
  end
end
"""

# New groups made ahead: they wait in the dataset's ready list until a lease takes them (`_LEASE_START`), so leases
# by several buffer processes never race for the cursor; only these read-aheads do, a few hundred groups at a time.
# ARGV: ns, dataset, expected cursor, new cursor, then (gid, payload) pairs, "--", (skip reason, count) pairs.
# Returns the ready list's length.
_STAGE = """
local ns, dataset, expected, cursor = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local current = redis.call('HGET', ns .. ':meta', 'cursor:' .. dataset) or ''
if current ~= expected then return redis.error_reply('CONTENDED cursor moved: ' .. current .. ' ~= ' .. expected) end
redis.call('HSET', ns .. ':meta', 'cursor:' .. dataset, cursor)
local ready, payloads, gids, i = ns .. ':ready:' .. dataset, {}, {}, 5
while ARGV[i] ~= '--' do
  payloads[#payloads + 1], payloads[#payloads + 2] = ns .. ':group:' .. ARGV[i], ARGV[i + 1]
  gids[#gids + 1] = ARGV[i]
  i = i + 2
end
if #gids > 0 then
  call_in_parts('MSET', nil, payloads)
  call_in_parts('RPUSH', ready, gids)
end
i = i + 1
while ARGV[i] do
  redis.call('HINCRBY', ns .. ':counters', 'skipped:' .. ARGV[i], tonumber(ARGV[i + 1]))
  i = i + 2
end
return redis.call('LLEN', ready)
"""

# The start of a lease, in one round trip: expiry, the returned groups, then new groups from the ready list as the
# bounds allow. ARGV: ns, dataset, want, lease ms, cap, then the bound on live groups as a function of the policy
# version v that expiry reads: min(v * per_version + base, fixed) (per_version, fixed: -1 for none), then whether new
# groups count as started ('1'). Returns expired, version, deadline, started, dropped, pending, leased, completed and
# ready sizes, then (gid, lease id, payload) triples.
_LEASE_START = """
local ns, dataset, want, lease_ms, cap = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local per_version, base, fixed, count_started = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9]
local expired, version = expire(ns)
local limit = -1
if per_version >= 0 then limit = version * per_version + base end
if fixed >= 0 and (limit < 0 or fixed < limit) then limit = fixed end
local deadline, leased = lease_pending(ns, dataset, want, lease_ms, cap, limit)
local ready = ns .. ':ready:' .. dataset
local n = math.min(want - #leased / 3, room(ns, cap, limit))
local gids = {}
if n > 0 then
  gids = redis.call('LRANGE', ready, 0, n - 1)
  redis.call('LTRIM', ready, #gids, -1)
end
local scores, lease_ids, statuses = {}, {}, {}
for j, gid in ipairs(gids) do
  local lease_id = gid .. '#' .. redis.call('HINCRBY', ns .. ':attempts', gid, 1)
  scores[2 * j - 1], scores[2 * j] = deadline, gid
  lease_ids[2 * j - 1], lease_ids[2 * j] = gid, lease_id
  statuses[2 * j - 1], statuses[2 * j] = gid, 'leased'
  table.insert(leased, gid)
  table.insert(leased, lease_id)
  table.insert(leased, redis.call('GET', ns .. ':group:' .. gid))
end
if #gids > 0 then
  call_in_parts('ZADD', ns .. ':leases', scores)
  call_in_parts('HSET', ns .. ':lease_id', lease_ids)
  call_in_parts('HSET', ns .. ':status', statuses)
  if count_started == '1' then redis.call('HINCRBY', ns .. ':counters', 'started', #gids) end
  redis.call('HINCRBY', ns .. ':counters', 'leases', #gids)
end
local c = redis.call('HMGET', ns .. ':counters', 'started', 'dropped')
local out = {expired, version, deadline, tonumber(c[1] or '0'), tonumber(c[2] or '0'),
             redis.call('LLEN', ns .. ':pending:' .. dataset), redis.call('ZCARD', ns .. ':leases'),
             redis.call('ZCARD', ns .. ':done'), redis.call('LLEN', ready)}
for _, v in ipairs(leased) do table.insert(out, v) end
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
local expired, version = expire(ARGV[1])
return {expired, version}
"""

# ARGV: ns, lease id, outcome ("completed" | "dropped:<reason>" | "eval:<dataset>"), payload (the group without its
# samples' arrays), min version, tokens, arrays ('' when uploaded), uploaded ('1': the arrays are at upload:<lease id>)
_SUBMIT = """
local result, completed = submit(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8] == '1')
if completed then redis.call('PUBLISH', ARGV[1] .. ':submitted', completed) end
return result
"""

# ARGV: ns, step, chosen gids... Returns 0 when the step has a batch already (another buffer process made it).
_RECORD_BATCH = """
local ns, step, n = ARGV[1], ARGV[2], #ARGV - 2
local last = tonumber(redis.call('HGET', ns .. ':meta', 'last_committed_step') or '-1')
if tonumber(step) <= last then return redis.error_reply('step ' .. step .. ' was already committed') end
if redis.call('EXISTS', ns .. ':batch:' .. step) == 1 then return 0 end
local top = tonumber(redis.call('HGET', ns .. ':meta', 'top_step') or '-1')
if tonumber(step) > top + 1 then return redis.error_reply('steps are handed out in order: step ' .. (top + 1)) end
-- Check before writing: an error after a write would leave the write in place.
for i = 3, 2 + n do
  if not redis.call('ZSCORE', ns .. ':done', ARGV[i]) then
    return redis.error_reply('CONTENDED ' .. ARGV[i] .. ' is not completed')
  end
end
local chosen = {}
for i = 3, 2 + n do
  local gid = ARGV[i]
  redis.call('ZREM', ns .. ':done', gid)
  redis.call('HSET', ns .. ':status', gid, 'batch:' .. step)
  table.insert(chosen, gid)
end
redis.call('SET', ns .. ':batch:' .. step, cjson.encode(chosen))
if tonumber(step) > top then redis.call('HSET', ns .. ':meta', 'top_step', step) end
return 1
"""

_DROP = """
local ns, reason = ARGV[1], ARGV[2]
local dropped = 0
for i = 3, #ARGV do
  local gid = ARGV[i]
  if redis.call('ZREM', ns .. ':done', gid) == 1 then
    redis.call('DEL', ns .. ':done:' .. gid, ns .. ':arrays:' .. gid)
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
  redis.call('DEL', ns .. ':done:' .. gid, ns .. ':arrays:' .. gid)
  redis.call('HDEL', ns .. ':done_version', gid)
  redis.call('HDEL', ns .. ':done_tokens', gid)
  redis.call('HSET', ns .. ':status', gid, 'trained:' .. step)
end
redis.call('DEL', ns .. ':batch:' .. step)
redis.call('HSET', ns .. ':meta', 'last_committed_step', step)
redis.call('HINCRBY', ns .. ':counters', 'trained', #gids)
return #gids
"""

# ARGV: ns, step, version, then (gid, prompt payload) pairs of the groups that go back: those of the batches of `step`
# and later, the completed ones of a version after `version` (and others the caller chose: a failed reward's) and the
# leased ones. Refused when those are not the groups given (another buffer process leased or batched meanwhile).
_REWIND = """
local ns, step, version = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local last = tonumber(redis.call('HGET', ns .. ':meta', 'last_committed_step') or '-1')
if step <= last then return redis.error_reply('step ' .. last .. ' was already committed') end
local top = tonumber(redis.call('HGET', ns .. ':meta', 'top_step') or '-1')
local given, expected = {}, 0
for i = 4, #ARGV, 2 do given[ARGV[i]] = true end
local function goes_back(gid)
  expected = expected + 1
  return given[gid]
end
for k = step, top do
  for _, gid in ipairs(cjson.decode(redis.call('GET', ns .. ':batch:' .. k) or '[]')) do
    if not goes_back(gid) then return redis.error_reply('CONTENDED batch ' .. k .. ' changed') end
  end
end
for _, gid in ipairs(redis.call('ZRANGE', ns .. ':done', 0, -1)) do
  if given[gid] then
    expected = expected + 1
  elseif tonumber(redis.call('HGET', ns .. ':done_version', gid) or '0') > tonumber(version) then
    return redis.error_reply('CONTENDED ' .. gid .. ' completed meanwhile')
  end
end
for _, gid in ipairs(redis.call('ZRANGE', ns .. ':leases', 0, -1)) do
  if not goes_back(gid) then return redis.error_reply('CONTENDED ' .. gid .. ' leased meanwhile') end
end
if expected ~= (#ARGV - 3) / 2 then return redis.error_reply('CONTENDED groups changed') end
for k = step, top do redis.call('DEL', ns .. ':batch:' .. k) end
if top >= step then redis.call('HSET', ns .. ':meta', 'top_step', step - 1) end
local back = 0
for i = #ARGV - 1, 4, -2 do  -- backwards, so that LPUSH leaves them in their order
  local gid, payload = ARGV[i], ARGV[i + 1]
  redis.call('ZREM', ns .. ':done', gid)
  redis.call('ZREM', ns .. ':leases', gid)
  redis.call('DEL', ns .. ':done:' .. gid, ns .. ':arrays:' .. gid)
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

# ARGV: ns, version. The policy version only grows; returns the version now.
_RAISE_VERSION = """
local ns, version = ARGV[1], tonumber(ARGV[2])
local current = tonumber(redis.call('HGET', ns .. ':meta', 'policy_version') or '0')
if version > current then redis.call('HSET', ns .. ':meta', 'policy_version', version) end
return math.max(version, current)
"""

# violations()' reads, at one instant: the statuses, the leased groups and the completed ones
_SNAPSHOT = """
local ns = ARGV[1]
return {redis.call('HGETALL', ns .. ':status'), redis.call('ZRANGE', ns .. ':leases', 0, -1),
        redis.call('ZRANGE', ns .. ':done', 0, -1)}
"""


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
        self._scripts = {
            name: redis.register_script(SUBMIT_FUNCTIONS + _PRELUDE + code)
            for name, code in [
                ("stage", _STAGE),
                ("lease_start", _LEASE_START),
                ("extend", _EXTEND),
                ("release", _RELEASE),
                ("expire", _EXPIRE),
                ("submit", _SUBMIT),
                ("record_batch", _RECORD_BATCH),
                ("drop", _DROP),
                ("commit", _COMMIT),
                ("rewind", _REWIND),
                ("raise_version", _RAISE_VERSION),
                ("snapshot", _SNAPSHOT),
            ]
        }

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
