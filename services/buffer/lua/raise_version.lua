-- ARGV: ns, version. The policy version only grows; returns the version now.
local ns, version = ARGV[1], tonumber(ARGV[2])
local current = tonumber(redis.call('HGET', ns .. ':meta', 'policy_version') or '0')
if version > current then redis.call('HSET', ns .. ':meta', 'policy_version', version) end
return math.max(version, current)
