-- Bring a packet's state into Redis from the database, atomically: the first publish after a send, and
-- recovery after Redis lost it. Safe while grabs continue (a script runs alone) and safe to repeat.
-- KEYS[1] meta hash, KEYS[2] shares list, KEYS[3] grabs hash
-- ARGV[1] expire-at (unix ms) for all keys
-- ARGV[2] number of meta field/value pairs n, then 2n meta items
-- then: number of shares m, then m items 'seq:amount' (every share of the packet, in hand-out order)
-- then: number of grabs k, then 2k items user, 'seq:amount:ms' (grabs the database already holds)
-- Shares taken by a grab in either Redis or the database are never put back in the list.
-- Returns {shares left, grabs known}.
local i = 2
local n = tonumber(ARGV[i]); i = i + 1
local fields = {}
for j = 1, n do
  fields[#fields + 1] = ARGV[i]; fields[#fields + 1] = ARGV[i + 1]; i = i + 2
end
local m = tonumber(ARGV[i]); i = i + 1
local shares = {}
for j = 1, m do shares[j] = ARGV[i]; i = i + 1 end
local k = tonumber(ARGV[i]); i = i + 1

-- Grabs Redis already holds win: they may be newer than the database.
local taken = {}
local held = redis.call('HGETALL', KEYS[3])
for j = 2, #held, 2 do
  taken[string.match(held[j], '^(%d+):')] = true
end
for j = 1, k do
  local user, rec = ARGV[i], ARGV[i + 1]; i = i + 2
  local seq = string.match(rec, '^(%d+):')
  redis.call('HSETNX', KEYS[3], user, rec)
  taken[seq] = true
end

-- Meta fields already in Redis (finished_ms, closed) are kept; missing ones are filled in.
for j = 1, #fields, 2 do
  redis.call('HSETNX', KEYS[1], fields[j], fields[j + 1])
end

redis.call('DEL', KEYS[2])
local left = 0
for j = 1, m do
  local seq = string.match(shares[j], '^(%d+):')
  if not taken[seq] then
    redis.call('RPUSH', KEYS[2], shares[j]); left = left + 1
  end
end
for j = 1, 3 do redis.call('PEXPIREAT', KEYS[j], ARGV[1]) end
return {left, redis.call('HLEN', KEYS[3])}
