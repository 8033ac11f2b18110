-- Fill a group's member cache, unless membership changed since the caller read the version.
-- Its caller builds KEYS and ARGV by name: server/store/scriptcalls.py, FillMembersCall.
local members_key = KEYS[1]   -- the member set
local version_key = KEYS[2]   -- the membership version counter (same hash tag)
local read_version = ARGV[1]  -- the version read before the database was read ('' if none)
local ttl = ARGV[2]           -- seconds
-- ARGV[3] the LOADED marker, ARGV[4..] member ids: added to the set as they come.
-- Returns 1 when the cache was written, 0 when a change raced the read (the caller caches nothing).
local now = redis.call('GET', version_key) or ''
if now ~= read_version then
  return 0
end
redis.call('DEL', members_key)
for i = 3, #ARGV, 5000 do
  redis.call('SADD', members_key, unpack(ARGV, i, math.min(i + 4999, #ARGV)))
end
redis.call('EXPIRE', members_key, ttl)
return 1
