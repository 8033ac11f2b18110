-- What a group's stream holds after an offset, read at one moment: whether the stream exists, how many
-- entries it has and ever had, its first and last ids, and the entries after the offset.
-- Its caller builds KEYS and ARGV by name: server/store/scriptcalls.py, ReadEventsCall.
local stream_key = KEYS[1]  -- the group's event stream
local after = ARGV[1]       -- the offset (exclusive)
local limit = ARGV[2]       -- most entries to return
-- Returns {0} when there is no stream, else {1, length, entries-added, first id, last id, entries}.
if redis.call('EXISTS', stream_key) == 0 then
  return {0}
end
local info = redis.call('XINFO', 'STREAM', stream_key)
local f = {}
for j = 1, #info, 2 do
  f[info[j]] = info[j + 1]
end
local first = f['recorded-first-entry-id'] or ''
local rows = redis.call('XRANGE', stream_key, '(' .. after, '+', 'COUNT', limit)
return {1, f['length'], f['entries-added'], first, f['last-generated-id'], rows}
