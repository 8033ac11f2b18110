-- Finish claimed arq jobs as arq does: out of the queue, job and in-progress keys deleted, the result
-- kept for a while (while it exists, enqueueing the same job id again is a no-op).
-- KEYS[1] the queue -- ARGV[1] in-progress prefix, ARGV[2] job prefix, ARGV[3] result prefix,
-- ARGV[4] result TTL ms, then pairs ARGV[5..]: id, result payload ('' for none)
for i = 5, #ARGV, 2 do
  local id, result = ARGV[i], ARGV[i + 1]
  redis.call('ZREM', KEYS[1], id)
  redis.call('DEL', ARGV[2] .. id, ARGV[1] .. id)
  if result ~= '' then
    redis.call('SET', ARGV[3] .. id, result, 'PX', ARGV[4])
  end
end
return (#ARGV - 4) / 2
