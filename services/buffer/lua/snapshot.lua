-- ARGV: ns. violations()' reads, at one instant: the statuses, the leased groups and the completed ones.
local ns = ARGV[1]
return {redis.call('HGETALL', ns .. ':status'), redis.call('ZRANGE', ns .. ':leases', 0, -1),
        redis.call('ZRANGE', ns .. ':done', 0, -1)}
