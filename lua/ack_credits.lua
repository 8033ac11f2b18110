-- Settle credits a worker has committed to the database: take them off the shard's outbox (acknowledged
-- and deleted) and mark their shares paid, in one call on the shard's slot.
-- KEYS[1] the shard's credit outbox, KEYS[2..] the paid-seqs sets of the packets concerned
-- ARGV[1] the consumer group, ARGV[2] the paid sets' TTL (s), ARGV[3] n entry ids, ARGV[4..3+n] the ids,
-- then for each paid set in KEYS order: how many seqs, then the seqs
-- Returns how many entries were acknowledged.
local n = tonumber(ARGV[3])
local acked = 0
if n > 0 then
  local ids = {unpack(ARGV, 4, 3 + n)}
  acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
  redis.call('XDEL', KEYS[1], unpack(ids))
end
local i = 4 + n
for k = 2, #KEYS do
  local m = tonumber(ARGV[i])
  if m > 0 then
    redis.call('SADD', KEYS[k], unpack(ARGV, i + 1, i + m))
    redis.call('EXPIRE', KEYS[k], ARGV[2])
  end
  i = i + 1 + m
end
return acked
