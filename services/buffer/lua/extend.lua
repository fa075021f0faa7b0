-- ARGV: ns, lease ms, lease ids. Moves the deadline of each lease still held to now + lease ms; returns the deadline,
-- then 1 or 0 for each lease id (0: not held).
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
