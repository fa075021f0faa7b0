-- ARGV: ns, lease id, payload ('' keeps the stored one). Sends a leased group back to its dataset's pending list;
-- returns 1, or 0 when the lease is not held.
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
