-- Append one event to a group's capped stream and publish it, atomically: the pub/sub order is the
-- stream order, and the offset every hub sends is the stream id.
-- KEYS[1] the group's event stream
-- ARGV[1] the group's channel, ARGV[2] approximate max length, ARGV[3] payload, ARGV[4] stream TTL (s)
-- Returns the new event's offset.
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'e', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('PUBLISH', ARGV[1], id .. '\n' .. ARGV[3])
return id
