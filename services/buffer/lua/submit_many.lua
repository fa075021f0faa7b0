-- A worker's training groups completed together. ARGV: ns, then for each group: lease id, payload, min version,
-- tokens, arrays ('' when uploaded), uploaded. Returns each group's answer as `submit`'s; one message on
-- <ns>:submitted for them all.
local ns, results, last = ARGV[1], {}, nil
for i = 2, #ARGV, 6 do
  local result, completed = submit(ns, ARGV[i], 'completed', ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4],
                                   ARGV[i + 5] == '1')
  table.insert(results, result)
  last = completed or last
end
if last then redis.call('PUBLISH', ns .. ':submitted', last) end
return results
