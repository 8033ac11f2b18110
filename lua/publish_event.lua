-- Append one event to a group's capped stream and publish it, atomically: the pub/sub order is the
-- stream order, and the offset every hub sends is the stream id. The channel is a sharded one in the
-- group's slot (SPUBLISH), so this runs on a Redis Cluster as on one server.
-- KEYS[1] the group's event stream
-- KEYS[2] (optional, same slot) the event's once-key: if it exists the event was published before, and
--         its offset is returned without publishing again; else it is set to the new offset
-- ARGV[1] the group's channel, ARGV[2] approximate max length, ARGV[3] payload, ARGV[4] stream TTL (s)
-- ARGV[5] the once-key's TTL (s), with KEYS[2]
-- Returns the event's offset.
if KEYS[2] then
  local before = redis.call('GET', KEYS[2])
  if before then
    return before
  end
end
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'e', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('SPUBLISH', ARGV[1], id .. '\n' .. ARGV[3])
if KEYS[2] then
  redis.call('SET', KEYS[2], id, 'EX', ARGV[5])
end
return id
