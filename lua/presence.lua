-- Presence of one user in one group, across hubs. A hub joins, refreshes and leaves for its own
-- connections; an entry of a hub that died lapses by itself.
-- KEYS[1] group's online zset (user → lapse ms), KEYS[2] this user's hash (hub → lapse ms)
-- ARGV[1] 'join' | 'refresh' | 'leave', ARGV[2] user id, ARGV[3] hub id, ARGV[4] lapse ms (for join)
-- Returns 1 when the user came online (join) or went offline (leave) in this call, else 0.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local before = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[2]) or '0')
if ARGV[1] ~= 'leave' then
  redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
  redis.call('ZADD', KEYS[1], 'GT', ARGV[4], ARGV[2])
  for k = 1, 2 do
    if redis.call('PTTL', KEYS[k]) < tonumber(ARGV[4]) - now then
      redis.call('PEXPIREAT', KEYS[k], ARGV[4])
    end
  end
  if ARGV[1] == 'refresh' or before > now then return 0 end
  return 1
end
redis.call('HDEL', KEYS[2], ARGV[3])
local latest = 0
local hubs = redis.call('HGETALL', KEYS[2])
for i = 2, #hubs, 2 do
  local lapse = tonumber(hubs[i])
  if lapse > now and lapse > latest then latest = lapse end
end
if latest > 0 then
  redis.call('ZADD', KEYS[1], latest, ARGV[2])
  return 0
end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[2])
if before > now then return 1 end
return 0
