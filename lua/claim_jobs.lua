-- Claim due queued arq jobs the way arq does (its in-progress key, set only if absent, with a TTL) and
-- return each claimed job's id and payload, in one call. Jobs another worker holds are stepped over.
-- (arq's keys share no hash slot: the queue lives on a standalone Redis, as arq requires.)
-- KEYS[1] the queue -- ARGV[1] in-progress prefix, ARGV[2] job prefix, ARGV[3] claim ms,
-- ARGV[4] due until (score, unix ms), ARGV[5] how many to claim, ARGV[6] job id prefix to take,
-- ARGV[7] most queue entries to look at
-- Returns {id1, payload1, id2, payload2, ...} (payload false when the job expired)
local out, want, seen, offset = {}, tonumber(ARGV[5]), 0, 0
local prefix, look = ARGV[6], tonumber(ARGV[7])
while #out < 2 * want and seen < look do
  local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[4], 'LIMIT', offset, 500)
  if #ids == 0 then
    break
  end
  offset = offset + #ids
  for _, id in ipairs(ids) do
    seen = seen + 1
    if string.sub(id, 1, #prefix) == prefix
      and redis.call('SET', ARGV[1] .. id, 'drain', 'NX', 'PX', ARGV[3]) then
      out[#out + 1] = id
      out[#out + 1] = redis.call('GET', ARGV[2] .. id) or false
      if #out == 2 * want then
        break
      end
    end
  end
end
return out
