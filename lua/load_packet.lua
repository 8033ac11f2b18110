-- Bring a packet's state into Redis from the database, atomically: the first publish after a send, and
-- the repair after Redis lost writes (a restart, a failover to a replica that lagged). Safe while
-- grabs continue (a script runs alone) and safe to repeat. One slot: the packet's keys and its shard's
-- credit outbox.
-- KEYS[1] meta hash, KEYS[2] shares list, KEYS[3] grabs hash, KEYS[4] the grabs repairs dropped (a list),
-- KEYS[5] credit outbox
-- ARGV[1] expire-at (unix ms) for the packet's keys, ARGV[2] packet id
-- ARGV[3] number of meta field/value pairs n, then 2n meta items
-- then: number of shares m, then m items 'seq:amount' (every share of the packet, in hand-out order)
-- then: number of grabs k, then 2k items user, 'seq:amount:ms' (grabs the database already holds)
--
-- The database wins: a grab Redis holds that conflicts with one the database holds (the same share to
-- another user, or another share to the same user) can only be a grab made on data Redis has since
-- lost; it is dropped, with its credit record, and the database's grab put in its place. Its grabber
-- may have been told "won": it is kept in KEYS[4] until the ledger has recorded it as refused. Grabs
-- only Redis holds (not yet paid) are kept. A share taken in either is never put back in the list.
-- Returns {shares left, grabs known, every grab in KEYS[4] as 'user:seq:amount:ms'}.
local i = 3
local n = tonumber(ARGV[i]); i = i + 1
local fields = {}
for j = 1, n do
  fields[#fields + 1] = ARGV[i]; fields[#fields + 1] = ARGV[i + 1]; i = i + 2
end
local m = tonumber(ARGV[i]); i = i + 1
local shares = {}
for j = 1, m do shares[j] = ARGV[i]; i = i + 1 end
local k = tonumber(ARGV[i]); i = i + 1
local db_user, db_seq = {}, {}
for j = 1, k do
  local user, rec = ARGV[i], ARGV[i + 1]; i = i + 2
  db_user[user] = rec
  db_seq[string.match(rec, '^(%d+):')] = user
end

local dropped = {}
local held = redis.call('HGETALL', KEYS[3])
for j = 1, #held, 2 do
  local user, rec = held[j], held[j + 1]
  local seq = string.match(rec, '^(%d+):')
  if (db_seq[seq] and db_seq[seq] ~= user) or (db_user[user] and db_user[user] ~= rec) then
    redis.call('HDEL', KEYS[3], user)
    redis.call('RPUSH', KEYS[4], user .. ':' .. rec)
    dropped[ARGV[2] .. ':' .. user .. ':' .. rec .. ':'] = true
  end
end
for user, rec in pairs(db_user) do
  redis.call('HSET', KEYS[3], user, rec)
end
if next(dropped) then
  -- Their credit records must not be paid: the database holds those shares for someone else.
  local entries = redis.call('XRANGE', KEYS[5], '-', '+')
  for _, e in ipairs(entries) do
    local c = e[2][2]
    local prefix = string.match(c, '^(%d+:%d+:%d+:%d+:%d+:)')
    if prefix and dropped[prefix] then
      redis.call('XDEL', KEYS[5], e[1])
    end
  end
end

local taken = {}
local now_held = redis.call('HGETALL', KEYS[3])
for j = 2, #now_held, 2 do
  taken[string.match(now_held[j], '^(%d+):')] = true
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
for j = 1, 4 do redis.call('PEXPIREAT', KEYS[j], ARGV[1]) end
return {left, redis.call('HLEN', KEYS[3]), redis.call('LRANGE', KEYS[4], 0, -1)}
