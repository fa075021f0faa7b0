-- The submit transition, in every script that completes groups: the buffer's SubmitGroup and a worker's own submit
-- (services/buffer/dataplane.py puts it before each). `dataset_of(gid)`: a group id starts with its dataset's name.
-- `submit`: a finished group completed with its arrays (given, or the worker's upload taken over), dropped or kept as
-- an evaluation's; returns the answer ('accepted', 'duplicate', 'unknown', 'no_arrays') and the group id when it was
-- completed now.
local function dataset_of(gid) return string.match(gid, '^([^:]*):') end
local function submit(ns, lease_id, outcome, payload, version, tokens, arrays, uploaded)
  local upload = ns .. ':upload:' .. lease_id
  local gid = string.match(lease_id, '^(.*)#%d+$')
  local status = gid and redis.call('HGET', ns .. ':status', gid)
  if not status then
    redis.call('DEL', upload)
    return 'unknown'
  end
  if status ~= 'leased' and status ~= 'pending' then
    redis.call('DEL', upload)
    redis.call('HINCRBY', ns .. ':counters', 'duplicate_submits', 1)
    return 'duplicate'
  end
  if uploaded and redis.call('EXISTS', upload) == 0 then return 'no_arrays' end
  redis.call('ZREM', ns .. ':leases', gid)
  if status == 'pending' then redis.call('LREM', ns .. ':pending:' .. dataset_of(gid), 0, gid) end
  redis.call('DEL', ns .. ':group:' .. gid)
  redis.call('HSET', ns .. ':status', gid, outcome)
  if outcome == 'completed' then
    local seq = redis.call('HINCRBY', ns .. ':counters', 'completed', 1)
    redis.call('SET', ns .. ':done:' .. gid, payload)
    if uploaded then
      redis.call('RENAME', upload, ns .. ':arrays:' .. gid)
      redis.call('PERSIST', ns .. ':arrays:' .. gid)
    else
      redis.call('SET', ns .. ':arrays:' .. gid, arrays)
    end
    redis.call('ZADD', ns .. ':done', seq, gid)
    redis.call('HSET', ns .. ':done_version', gid, version)
    redis.call('HSET', ns .. ':done_tokens', gid, tokens)
    return 'accepted', gid
  end
  redis.call('DEL', upload)
  if string.sub(outcome, 1, 5) == 'eval:' then
    redis.call('HSET', ns .. ':' .. outcome, gid, payload)
    redis.call('HINCRBY', ns .. ':counters', 'eval_completed', 1)
  else
    redis.call('HINCRBY', ns .. ':counters', 'dropped', 1)
    redis.call('HINCRBY', ns .. ':counters', outcome, 1)
  end
  return 'accepted'
end
