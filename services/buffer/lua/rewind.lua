-- ARGV: ns, step, version, then (gid, prompt payload) pairs of the groups that go back: those of the batches of `step`
-- and later, the completed ones of a version after `version` (and others the caller chose: a failed reward's) and the
-- leased ones. Refused when those are not the groups given (another buffer process leased or batched meanwhile).
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
