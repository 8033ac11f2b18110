-- Grab one share of a packet, atomically, and write its credit record in the same call: one round trip
-- per grab, and no moment where a share is taken but its credit is not recorded (only Redis itself
-- losing both can part them). O(1) commands only. Every key is in the group's shard (one hash slot), so
-- the script runs on a Redis Cluster as on one server.
--
-- KEYS[1] meta hash, KEYS[2] shares list, KEYS[3] grabs hash (the packet's keys)
-- KEYS[4] the group's member cache, KEYS[5] the shard's gate (blocks, throttles), KEYS[6] this user's
-- grab rate limit in this group (a string: when the next grab is due, unix ms), KEYS[7] the shard's
-- credit outbox (a stream)
-- ARGV[1] user id, ARGV[2] group id the client believes the packet is in, ARGV[3] packet id
-- ARGV[4] '1' to check the member cache, '0' when the caller has just checked the database
-- ARGV[5] grab tokens per second, ARGV[6] bucket size: ARGV[5] = '' skips block and rate limit
-- ARGV[7] the member cache's LOADED marker
-- ARGV[8] '1' when grabs are durable: a repeat grab writes its record again, so that the wait for
--         durability that follows covers it too
-- Returns {status, ...}:
--   {'won', 'seq:amount:ms', n}      a share was taken now and its credit recorded
--   {'already', 'seq:amount:ms', n}  this user grabbed before: the same answer
--   {'members'}                      the member cache is not loaded: load it, call again with ARGV[4]='0'
--   {'not_member'} {'blocked', ms left} {'limited', ms until a token}
--   {'empty'} {'expired'} {'not_target'} {'unknown'}
local user = ARGV[1]

if ARGV[4] == '1' then
  local m = redis.call('SMISMEMBER', KEYS[4], ARGV[7], user)
  if m[1] == 0 then
    return {'members'}
  end
  if m[2] == 0 then
    return {'not_member'}
  end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if ARGV[5] ~= '' then
  -- The checks about the user, not the packet: a block set by the bot detector, then a rate limit of
  -- grab attempts in this group shared by every hub (a throttle set by the bot detector lowers its rate).
  local gate = redis.call('HMGET', KEYS[5], 'b:' .. user, 't:' .. user)
  if gate[1] and tonumber(gate[1]) > now then
    return {'blocked', tonumber(gate[1]) - now}
  end
  local rate, burst = tonumber(ARGV[5]), tonumber(ARGV[6])
  if gate[2] then
    local slower, ends = string.match(gate[2], '^([%d.]+):(%d+)$')
    if slower and tonumber(ends) > now then
      rate = math.min(rate, tonumber(slower))
      burst = 1
    end
  end
  -- GCRA: the bucket is one number, when the next grab is due ("theoretical arrival time"); a grab
  -- may come up to (burst - 1) intervals early. The same answers as a token bucket of that size, with
  -- one read and, when the grab is allowed, one write.
  local every = math.floor(1000 / rate)
  local due = math.max(tonumber(redis.call('GET', KEYS[6]) or 0), now)
  local early = due - (burst - 1) * every - now
  if early > 0 then
    return {'limited', early}
  end
  redis.call('SET', KEYS[6], string.format('%d', due + every), 'PX', math.max(1, due + every - now + every))
end

local meta = redis.call('HMGET', KEYS[1], 'group', 'expires_ms', 'target', 'closed')
if not meta[1] or meta[1] ~= ARGV[2] then
  -- A packet of another group answers like a missing one: nothing leaks across groups.
  return {'unknown'}
end
local prev = redis.call('HGET', KEYS[3], user)
if prev then
  if ARGV[8] == '1' then
    redis.call('HSET', KEYS[3], user, prev)
  end
  return {'already', prev, redis.call('LLEN', KEYS[2])}
end
if meta[4] == '1' or now >= tonumber(meta[2]) then
  return {'expired'}
end
if meta[3] and meta[3] ~= '' and meta[3] ~= user then
  return {'not_target'}
end
local share = redis.call('LPOP', KEYS[2])
if not share then
  return {'empty'}
end
local record = share .. ':' .. now
redis.call('HSET', KEYS[3], user, record)
-- The credit, '<packet>:<user>:<seq>:<amount>:<ms>:<group>', for the workers' consumer group.
redis.call('XADD', KEYS[7], '*', 'c', ARGV[3] .. ':' .. user .. ':' .. record .. ':' .. ARGV[2])
local left = redis.call('LLEN', KEYS[2])
if left == 0 then
  redis.call('HSET', KEYS[1], 'finished_ms', now)
end
return {'won', record, left}
