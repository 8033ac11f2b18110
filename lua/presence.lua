-- Presence of users in one group, across hubs. A hub joins, refreshes and leaves for its own
-- connections, many users per call; an entry of a hub that died lapses by itself.
-- Its caller builds KEYS and ARGV by name: server/store/scriptcalls.py, PresenceCall.
local online_key = KEYS[1]  -- the group's online zset (user -> lapse ms); KEYS[1 + i]: user i's hash
                            -- (hub -> lapse ms)
local action = ARGV[1]      -- 'join' | 'refresh' | 'leave'
local hub = ARGV[2]         -- this hub's id
local lapse = ARGV[3]       -- lapse ms (join, refresh); ARGV[3 + i]: user i
-- Returns one number per user: 1 when that user came online (join) or went offline (leave) in this
-- call, else 0.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #KEYS - 1 do
  local user, hubs = ARGV[3 + i], KEYS[1 + i]
  local before = tonumber(redis.call('ZSCORE', online_key, user) or '0')
  local changed = 0
  if action ~= 'leave' then
    redis.call('HSET', hubs, hub, lapse)
    redis.call('ZADD', online_key, 'GT', lapse, user)
    if redis.call('PTTL', hubs) < tonumber(lapse) - now then
      redis.call('PEXPIREAT', hubs, lapse)
    end
    if action == 'join' and before <= now then changed = 1 end
  else
    redis.call('HDEL', hubs, hub)
    local latest = 0
    local others = redis.call('HGETALL', hubs)
    for k = 2, #others, 2 do
      local l = tonumber(others[k])
      if l > now and l > latest then latest = l end
    end
    if latest > 0 then
      redis.call('ZADD', online_key, latest, user)
    else
      redis.call('DEL', hubs)
      redis.call('ZREM', online_key, user)
      if before > now then changed = 1 end
    end
  end
  out[i] = changed
end
if action ~= 'leave' and redis.call('PTTL', online_key) < tonumber(lapse) - now then
  redis.call('PEXPIREAT', online_key, lapse)
end
return out
