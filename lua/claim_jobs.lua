-- Claim queued arq jobs the way arq does (its in-progress key, set only if absent, with a TTL) and
-- return each claimed job's id and payload, in one call. (arq's keys share no hash slot: the queue
-- lives on a standalone Redis, as arq requires.)
-- KEYS: none (the ids are data) -- ARGV[1] in-progress prefix, ARGV[2] job prefix, ARGV[3] claim ms,
-- ARGV[4..] job ids
-- Returns {id1, payload1, id2, payload2, ...} (payload false when the job expired)
local out = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  if redis.call('SET', ARGV[1] .. id, 'drain', 'NX', 'PX', ARGV[3]) then
    out[#out + 1] = id
    out[#out + 1] = redis.call('GET', ARGV[2] .. id) or false
  end
end
return out
