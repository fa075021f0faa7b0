-- ARGV: ns. Returns the expired leases' groups to the pool; {how many, the policy version}.
local expired, version = expire(ARGV[1])
return {expired, version}
