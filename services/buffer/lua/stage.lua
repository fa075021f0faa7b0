-- New groups made ahead: they wait in the dataset's ready list until a lease takes them (lease_start.lua), so leases
-- by several buffer processes never race for the cursor; only these read-aheads do, a few hundred groups at a time.
-- ARGV: ns, dataset, expected cursor, new cursor, then (gid, payload) pairs, "--", (skip reason, count) pairs.
-- Returns the ready list's length.
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
