-- Append one event to a group's capped stream and publish it, atomically: the pub/sub order is the
-- stream order, and the offset every hub sends is the stream id. The channel is a sharded one in the
-- group's slot (SPUBLISH), so this runs on a Redis Cluster as on one server.
-- Its caller builds KEYS and ARGV by name: server/store/scriptcalls.py, PublishEventCall.
local stream_key = KEYS[1]  -- the group's event stream
local once_key = KEYS[2]    -- (optional, same slot) the event's once-key: if it exists the event was
                            -- published before, and its offset is returned without publishing again;
                            -- else it is set to the new offset
local channel = ARGV[1]     -- the group's channel
local max_length = ARGV[2]  -- approximate
local payload = ARGV[3]
local stream_ttl = ARGV[4]  -- seconds
local once_ttl = ARGV[5]    -- seconds, with once_key
-- Returns the event's offset.
if once_key then
  local before = redis.call('GET', once_key)
  if before then
    return before
  end
end
local id = redis.call('XADD', stream_key, 'MAXLEN', '~', max_length, '*', 'e', payload)
redis.call('EXPIRE', stream_key, stream_ttl)
redis.call('SPUBLISH', channel, id .. '\n' .. payload)
if once_key then
  redis.call('SET', once_key, id, 'EX', once_ttl)
end
return id
