-- Settle credits a worker has committed to the database (or recorded as refused): take them off the
-- shard's outbox, acknowledged and deleted, in one call on the shard's slot.
-- KEYS[1] the shard's credit outbox
-- ARGV[1] the consumer group, ARGV[2..] the entry ids
-- Returns how many entries were acknowledged.
local group = ARGV[1]
local ids = {unpack(ARGV, 2)}
if #ids == 0 then
  return 0
end
local acked = redis.call('XACK', KEYS[1], group, unpack(ids))
redis.call('XDEL', KEYS[1], unpack(ids))
return acked
