-- What a group's stream holds after an offset, read at one moment: whether the stream exists, how many
-- entries it has and ever had, its first and last ids, and the entries after the offset.
-- KEYS[1] the group's event stream
-- ARGV[1] the offset (exclusive), ARGV[2] most entries to return
-- Returns {0} when there is no stream, else {1, length, entries-added, first id, last id, entries}.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0}
end
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local f = {}
for j = 1, #info, 2 do
  f[info[j]] = info[j + 1]
end
local first = f['recorded-first-entry-id'] or ''
local rows = redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2])
return {1, f['length'], f['entries-added'], first, f['last-generated-id'], rows}
