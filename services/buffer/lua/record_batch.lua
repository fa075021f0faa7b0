-- ARGV: ns, step, chosen gids... Returns 0 when the step has a batch already (another buffer process made it).
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
