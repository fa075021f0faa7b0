-- ARGV: ns, reason, gids. Drops those of the groups that still wait for a batch, counted under dropped:<reason>;
-- returns how many.
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
