-- ARGV: ns, step. Deletes what the step's batch consumed and marks its groups trained; returns how many, -1 when the
-- step was committed before.
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
