-- The start of a lease, in one round trip: expiry, the returned groups, then new groups from the ready list as the
-- bounds allow. ARGV: ns, dataset, want, lease ms, cap, then the bound on live groups as a function of the policy
-- version v that expiry reads: min(v * per_version + base, fixed) (per_version, fixed: -1 for none), then whether new
-- groups count as started ('1'). Returns expired, version, deadline, started, dropped, pending, leased, completed and
-- ready sizes, then (gid, lease id, payload) triples.
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
