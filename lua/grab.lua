-- Grab one share of a packet, atomically, and write its credit record in the same call: one round trip
-- per grab, and no moment where a share is taken but its credit is not recorded (only Redis itself
-- losing both can part them). O(1) commands only. Every key is in the group's shard (one hash slot), so
-- the script runs on a Redis Cluster as on one server.
--
-- Its caller builds KEYS and ARGV by name (server/store/scriptcalls.py, GrabCall); the records it writes
-- have the formats of server/store/records.py (GrabRecord, CreditEntry).
local meta_key = KEYS[1]        -- the packet's meta hash
local shares_key = KEYS[2]      -- the packet's shares list, 'seq:amount' each
local grabs_key = KEYS[3]       -- the packet's grabs hash: user -> 'seq:amount:ms'
local members_key = KEYS[4]     -- the group's member cache
local gate_key = KEYS[5]        -- the shard's gate (blocks, throttles)
local bucket_key = KEYS[6]      -- this user's grab rate limit in this group: when the next grab is due (ms)
local outbox_key = KEYS[7]      -- the shard's credit outbox (a stream)
local user = ARGV[1]
local group = ARGV[2]           -- the group the client believes the packet is in
local packet = ARGV[3]
local check_members = ARGV[4] == '1'  -- '0' when the caller has just checked the database
local rate_arg = ARGV[5]        -- grab tokens per second; '' skips the block list and the rate limit
local burst_arg = ARGV[6]       -- the rate limit's bucket size
local loaded_marker = ARGV[7]   -- the member cache's LOADED marker
local rewrite_repeat = ARGV[8] == '1'  -- durable grabs: a repeat grab writes its record again, so that
                                       -- the wait for durability that follows covers it too
local trace = ARGV[9]           -- absent, or the caller's trace context (W3C traceparent): the credit
                                -- record carries it to the worker (server/tracing.py)
-- Returns {status, ...}:
--   {'won', 'seq:amount:ms', n}      a share was taken now and its credit recorded
--   {'already', 'seq:amount:ms', n}  this user grabbed before: the same answer
--   {'members'}                      the member cache is not loaded: load it, call again without check_members
--   {'not_member'} {'blocked', ms left} {'limited', ms until a token}
--   {'empty'} {'expired'} {'not_target'} {'unknown'}

if check_members then
  local m = redis.call('SMISMEMBER', members_key, loaded_marker, user)
  if m[1] == 0 then
    return {'members'}
  end
  if m[2] == 0 then
    return {'not_member'}
  end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

if rate_arg ~= '' then
  -- The checks about the user, not the packet: a block set by the bot detector, then a rate limit of
  -- grab attempts in this group shared by every hub (a throttle set by the bot detector lowers its rate).
  local gate = redis.call('HMGET', gate_key, 'b:' .. user, 't:' .. user)
  if gate[1] and tonumber(gate[1]) > now then
    return {'blocked', tonumber(gate[1]) - now}
  end
  local rate, burst = tonumber(rate_arg), tonumber(burst_arg)
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
  local due = math.max(tonumber(redis.call('GET', bucket_key) or 0), now)
  local early = due - (burst - 1) * every - now
  if early > 0 then
    return {'limited', early}
  end
  redis.call('SET', bucket_key, string.format('%d', due + every), 'PX', math.max(1, due + every - now + every))
end

local meta = redis.call('HMGET', meta_key, 'group', 'expires_ms', 'target', 'closed')
if not meta[1] or meta[1] ~= group then
  -- A packet of another group answers like a missing one: nothing leaks across groups.
  return {'unknown'}
end
local prev = redis.call('HGET', grabs_key, user)
if prev then
  if rewrite_repeat then
    redis.call('HSET', grabs_key, user, prev)
  end
  return {'already', prev, redis.call('LLEN', shares_key)}
end
if meta[4] == '1' or now >= tonumber(meta[2]) then
  return {'expired'}
end
if meta[3] and meta[3] ~= '' and meta[3] ~= user then
  return {'not_target'}
end
local share = redis.call('LPOP', shares_key)
if not share then
  return {'empty'}
end
local record = share .. ':' .. now
redis.call('HSET', grabs_key, user, record)
-- The credit, '<packet>:<user>:<seq>:<amount>:<ms>:<group>', for the workers' consumer group.
local credit = packet .. ':' .. user .. ':' .. record .. ':' .. group
if trace then
  redis.call('XADD', outbox_key, '*', 'c', credit, 't', trace)
else
  redis.call('XADD', outbox_key, '*', 'c', credit)
end
local left = redis.call('LLEN', shares_key)
if left == 0 then
  redis.call('HSET', meta_key, 'finished_ms', now)
end
return {'won', record, left}
