-- Put before every script of the buffer's store, after the submit transition (submit_functions.lua).
-- `room`: how many more groups the bounds allow (cap: leased plus completed groups, -1 for none; limit: live training
-- groups, started minus dropped, -1 for none).
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
