-- Fill a group's member cache, unless membership changed since the caller read the version.
-- KEYS[1] member set, KEYS[2] membership version counter (same hash tag)
-- ARGV[1] version read before the database was read ('' if none), ARGV[2] TTL seconds,
-- ARGV[3] the LOADED marker, ARGV[4..] member ids
-- Returns 1 when the cache was written, 0 when a change raced the read (the caller caches nothing).
local now = redis.call('GET', KEYS[2]) or ''
if now ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
for i = 3, #ARGV, 5000 do
  redis.call('SADD', KEYS[1], unpack(ARGV, i, math.min(i + 4999, #ARGV)))
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
