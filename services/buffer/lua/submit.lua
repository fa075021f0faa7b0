-- ARGV: ns, lease id, outcome ("completed" | "dropped:<reason>" | "eval:<dataset>"), payload (the group without its
-- samples' arrays), min version, tokens, arrays ('' when uploaded), uploaded ('1': the arrays are at upload:<lease id>).
-- Returns submit's answer; a group completed now is announced on <ns>:submitted.
local result, completed = submit(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8] == '1')
if completed then redis.call('PUBLISH', ARGV[1] .. ':submitted', completed) end
return result
