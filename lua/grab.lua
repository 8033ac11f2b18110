-- Grab one share of a packet, atomically. O(1) commands only.
-- KEYS[1] meta hash, KEYS[2] shares list, KEYS[3] grabs hash (all with the packet's hash tag)
-- ARGV[1] user id, ARGV[2] group id the client believes the packet is in
-- Returns {status, record, remaining}:
--   {'won', 'seq:amount:ms', n}      a share was taken now
--   {'already', 'seq:amount:ms', n}  this user grabbed before; the same answer again, nothing taken
--   {'empty'} {'expired'} {'not_target'} {'unknown'}
local meta = redis.call('HMGET', KEYS[1], 'group', 'expires_ms', 'target', 'closed')
if not meta[1] or meta[1] ~= ARGV[2] then
  -- A packet of another group answers like a missing one: nothing leaks across groups.
  return {'unknown'}
end
local prev = redis.call('HGET', KEYS[3], ARGV[1])
if prev then
  return {'already', prev, redis.call('LLEN', KEYS[2])}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if meta[4] == '1' or now >= tonumber(meta[2]) then
  return {'expired'}
end
if meta[3] and meta[3] ~= '' and meta[3] ~= ARGV[1] then
  return {'not_target'}
end
local share = redis.call('LPOP', KEYS[2])
if not share then
  return {'empty'}
end
local record = share .. ':' .. now
redis.call('HSET', KEYS[3], ARGV[1], record)
local left = redis.call('LLEN', KEYS[2])
if left == 0 then
  redis.call('HSET', KEYS[1], 'finished_ms', now)
end
return {'won', record, left}
