-- Grab one share of a packet, atomically, and queue its credit in the same call: one round trip per
-- grab, and no moment where a share is taken but its credit is not queued (only Redis itself losing
-- both can part them). O(1) commands only.
--
-- This is the one script whose keys span slots (packet, group, user, queue): it needs a standalone
-- Redis, as arq's queue on the same server already does. The credit job's key names are built here from
-- prefixes made in server/keys.py, because the share's seq is known only after the pop.
--
-- KEYS[1] meta hash, KEYS[2] shares list, KEYS[3] grabs hash (the packet's hash tag)
-- KEYS[4] the group's member cache, KEYS[5] the user's block, KEYS[6] grab bucket, KEYS[7] throttle
-- KEYS[8] the arq queue (sorted set)
-- ARGV[1] user id, ARGV[2] group id the client believes the packet is in
-- ARGV[3] '1' to check the member cache, '0' when the caller has just checked the database
-- ARGV[4] grab tokens per second, ARGV[5] bucket size: ARGV[4] = '' skips block and rate limit
-- ARGV[6] packet id, ARGV[7] credit job id prefix ('credit:<packet>:'), ARGV[8] arq job key prefix,
-- ARGV[9] arq result key prefix, ARGV[10] credit job function name, ARGV[11] job TTL ms
-- ARGV[12] the member cache's LOADED marker
-- Returns {status, ...}:
--   {'won', 'seq:amount:ms', n}      a share was taken now and its credit queued
--   {'already', 'seq:amount:ms', n}  this user grabbed before: the same answer, credit queued if missing
--   {'members'}                      the member cache is not loaded: load it, call again with ARGV[3]='0'
--   {'not_member'} {'blocked', ttl_ms} {'limited', ms until a token}
--   {'empty'} {'expired'} {'not_target'} {'unknown'}
local user = ARGV[1]

if ARGV[3] == '1' then
  local m = redis.call('SMISMEMBER', KEYS[4], ARGV[12], user)
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
  local ttl = redis.call('PTTL', KEYS[5])
  if ttl ~= -2 then
    return {'blocked', ttl}
  end
  local rate, burst = tonumber(ARGV[4]), tonumber(ARGV[5])
  local throttle = redis.call('GET', KEYS[7])
  if throttle then
    rate = math.min(rate, tonumber(throttle))
    burst = 1
  end
  local b = redis.call('HMGET', KEYS[6], 'tokens', 'ms')
  local tokens, last = tonumber(b[1]) or burst, tonumber(b[2]) or now
  tokens = math.min(burst, tokens + (now - last) * rate / 1000)
  local allowed = tokens >= 1
  if allowed then
    tokens = tokens - 1
  end
  redis.call('HSET', KEYS[6], 'tokens', tostring(tokens), 'ms', now)
  redis.call('PEXPIRE', KEYS[6], math.ceil(burst * 1000 / rate) + 1000)
  if not allowed then
    return {'limited', math.ceil((1 - tokens) * 1000 / rate)}
  end
end

-- Queue the credit of a share as arq's own enqueue would (unless queued or its result kept): the job
-- is arq's msgpack map {t, f, a, k, et} with a = {packet, user, seq, amount, grabbed_ms}.
local function enqueue(record)
  local seq, amount, ms = string.match(record, '^(%d+):(%d+):(%d+)$')
  local job_id = ARGV[7] .. seq
  local job_key, result_key = ARGV[8] .. job_id, ARGV[9] .. job_id
  if redis.call('EXISTS', job_key, result_key) > 0 then
    return
  end
  local job = string.char(0x85)
    .. cmsgpack.pack('t') .. string.char(0xc0)
    .. cmsgpack.pack('f', ARGV[10], 'a') .. string.char(0x95)
    .. cmsgpack.pack(tonumber(ARGV[6]), tonumber(user), tonumber(seq), tonumber(amount), tonumber(ms))
    .. cmsgpack.pack('k') .. string.char(0x80)
    .. cmsgpack.pack('et', now)
  redis.call('SET', job_key, job, 'PX', ARGV[11])
  redis.call('ZADD', KEYS[8], now, job_id)
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
