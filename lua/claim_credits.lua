-- Claim credits for one worker: move up to ARGV[3] due entries from the queue to the claimed set, where
-- each is held until now + ARGV[2] (a lease the worker renews while it pays). Claims that lapsed (their
-- worker died or stalled) go back to the head of the queue first, so another worker takes them over
-- within one lease. Paying twice is harmless: the database credits each share once.
-- KEYS[1] the credit queue, KEYS[2] the claimed credits (both sorted sets of credit entries)
-- ARGV[1] now (unix ms), ARGV[2] lease ms, ARGV[3] most entries to claim
-- Returns the claimed entries.
local now, lease, want = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])

local function move(entries, to, score)
  for i = 1, #entries, 500 do
    local chunk, args = {}, {}
    for j = i, math.min(i + 499, #entries) do
      chunk[#chunk + 1] = entries[j]
      args[#args + 1] = score
      args[#args + 1] = entries[j]
    end
    redis.call('ZREM', to == KEYS[1] and KEYS[2] or KEYS[1], unpack(chunk))
    redis.call('ZADD', to, unpack(args))
  end
end

move(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 5000), KEYS[1], 0)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, want)
move(due, KEYS[2], now + lease)
return due
