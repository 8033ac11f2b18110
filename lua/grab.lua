-- Grab one share of a packet, atomically, and queue its credit in the same call: one round trip per
-- grab, and no moment where a share is taken but its credit is not queued (only Redis itself losing
-- both can part them). O(1) commands only.
--
-- This is the one script whose keys span slots (packet, group, user, credit queue): it needs a
-- standalone Redis.
--
-- KEYS[1] meta hash, KEYS[2] shares list, KEYS[3] grabs hash, KEYS[4] paid seqs (the packet's hash tag)
-- KEYS[5] the group's member cache, KEYS[6] the user's block, KEYS[7] grab bucket, KEYS[8] throttle
-- KEYS[9] the credit queue, KEYS[10] the credits being paid (sorted sets of credit entries)
-- ARGV[1] user id, ARGV[2] group id the client believes the packet is in
-- ARGV[3] '1' to check the member cache, '0' when the caller has just checked the database
-- ARGV[4] grab tokens per second, ARGV[5] bucket size: ARGV[4] = '' skips block and rate limit
-- ARGV[6] packet id, ARGV[7] the member cache's LOADED marker
-- Returns {status, ...}:
--   {'won', 'seq:amount:ms', n}      a share was taken now and its credit queued
--   {'already', 'seq:amount:ms', n}  this user grabbed before: the same answer, credit queued if missing
--   {'members'}                      the member cache is not loaded: load it, call again with ARGV[3]='0'
--   {'not_member'} {'blocked', ttl_ms} {'limited', ms until a token}
--   {'empty'} {'expired'} {'not_target'} {'unknown'}
local user = ARGV[1]

if ARGV[3] == '1' then
  local m = redis.call('SMISMEMBER', KEYS[5], ARGV[7], user)
  if m[1] == 0 then
    return {'members'}
  end
  if m[2] == 0 then
    return {'not_member'}
  end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if ARGV[4] ~= '' then
  -- The checks about the user, not the packet: a block set by the bot detector, then a token bucket of
  -- grab attempts shared by every hub (a throttle set by the bot detector lowers its rate).
  local ttl = redis.call('PTTL', KEYS[6])
  if ttl ~= -2 then
    return {'blocked', ttl}
  end
  local rate, burst = tonumber(ARGV[4]), tonumber(ARGV[5])
  local throttle = redis.call('GET', KEYS[8])
  if throttle then
    rate = math.min(rate, tonumber(throttle))
    burst = 1
  end
  local b = redis.call('HMGET', KEYS[7], 'tokens', 'ms')
  local tokens, last = tonumber(b[1]) or burst, tonumber(b[2]) or now
  tokens = math.min(burst, tokens + (now - last) * rate / 1000)
  local allowed = tokens >= 1
  if allowed then
    tokens = tokens - 1
  end
  redis.call('HSET', KEYS[7], 'tokens', tostring(tokens), 'ms', now)
  redis.call('PEXPIRE', KEYS[7], math.ceil(burst * 1000 / rate) + 1000)
  if not allowed then
    return {'limited', math.ceil((1 - tokens) * 1000 / rate)}
  end
end

-- Queue the credit of a share: its entry '<packet>:<user>:<seq>:<amount>:<ms>' in the credit queue, due
-- now, unless it is queued, being paid, or paid already (a repeat grab after a lost credit queues it again).
local function enqueue(record)
  local seq = string.match(record, '^(%d+):')
  if redis.call('SISMEMBER', KEYS[4], seq) == 1 then
    return
  end
  local entry = ARGV[6] .. ':' .. user .. ':' .. record
  if not redis.call('ZSCORE', KEYS[10], entry) then
    redis.call('ZADD', KEYS[9], 'NX', now, entry)
  end
end

local meta = redis.call('HMGET', KEYS[1], 'group', 'expires_ms', 'target', 'closed')
if not meta[1] or meta[1] ~= ARGV[2] then
  -- A packet of another group answers like a missing one: nothing leaks across groups.
  return {'unknown'}
end
local prev = redis.call('HGET', KEYS[3], user)
if prev then
  enqueue(prev)
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
enqueue(record)
local left = redis.call('LLEN', KEYS[2])
if left == 0 then
  redis.call('HSET', KEYS[1], 'finished_ms', now)
end
return {'won', record, left}
