-- Bring a packet's state into Redis from the database, atomically: the first publish after a send, and
-- the repair after Redis lost writes (a restart, a failover to a replica that lagged). Safe while
-- grabs continue (a script runs alone) and safe to repeat. One slot: the packet's keys and its shard's
-- credit outbox.
-- Its caller builds KEYS and ARGV by name: server/store/scriptcalls.py, LoadPacketCall.
local meta_key = KEYS[1]     -- the packet's meta hash
local shares_key = KEYS[2]   -- the packet's shares list
local grabs_key = KEYS[3]    -- the packet's grabs hash
local dropped_key = KEYS[4]  -- the grabs repairs dropped (a list)
local outbox_key = KEYS[5]   -- the shard's credit outbox
local expire_at = ARGV[1]    -- expire-at (unix ms) for the packet's keys
local packet = ARGV[2]
local stamp_field = ARGV[3]  -- the meta field that names the server the state was loaded on
local stamp = ARGV[4]        -- that server as the loader saw it ('' not known): written over any before
-- ARGV[5] number of meta field/value pairs n, then 2n meta items
-- then: number of shares m, then m items 'seq:amount' (every share of the packet, in hand-out order)
-- then: number of grabs k, then 2k items user, 'seq:amount:ms' (grabs the database already holds)
--
-- The database wins: a grab Redis holds that conflicts with one the database holds (the same share to
-- another user, or another share to the same user) can only be a grab made on data Redis has since
-- lost; it is dropped, with its credit record, and the database's grab put in its place. Its grabber
-- may have been told "won": it is kept in dropped_key until the ledger has recorded it as refused. Grabs
-- only Redis holds (not yet paid) are kept. A share taken in either is never put back in the list.
-- Returns {shares left, grabs known, every grab in dropped_key as 'user:seq:amount:ms'}.
local i = 5
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
local held = redis.call('HGETALL', grabs_key)
for j = 1, #held, 2 do
  local user, rec = held[j], held[j + 1]
  local seq = string.match(rec, '^(%d+):')
  if (db_seq[seq] and db_seq[seq] ~= user) or (db_user[user] and db_user[user] ~= rec) then
    redis.call('HDEL', grabs_key, user)
    redis.call('RPUSH', dropped_key, user .. ':' .. rec)
    dropped[packet .. ':' .. user .. ':' .. rec .. ':'] = true
  end
end
for user, rec in pairs(db_user) do
  redis.call('HSET', grabs_key, user, rec)
end
if next(dropped) then
  -- Their credit records must not be paid: the database holds those shares for someone else.
  local entries = redis.call('XRANGE', outbox_key, '-', '+')
  for _, e in ipairs(entries) do
    local c = e[2][2]
    local prefix = string.match(c, '^(%d+:%d+:%d+:%d+:%d+:)')
    if prefix and dropped[prefix] then
      redis.call('XDEL', outbox_key, e[1])
    end
  end
end

local taken = {}
local now_held = redis.call('HGETALL', grabs_key)
for j = 2, #now_held, 2 do
  taken[string.match(now_held[j], '^(%d+):')] = true
end

-- Meta fields already in Redis (finished_ms, closed) are kept; missing ones are filled in.
for j = 1, #fields, 2 do
  redis.call('HSETNX', meta_key, fields[j], fields[j + 1])
end
-- Loaded (or checked) on this server: a process that meets the packet later trusts this state without
-- the database while the server is still the one named here (server/store/repair.py).
if stamp ~= '' then
  redis.call('HSET', meta_key, stamp_field, stamp)
else
  redis.call('HDEL', meta_key, stamp_field)
end

redis.call('DEL', shares_key)
local left = 0
for j = 1, m do
  local seq = string.match(shares[j], '^(%d+):')
  if not taken[seq] then
    redis.call('RPUSH', shares_key, shares[j]); left = left + 1
  end
end
for _, key in ipairs({meta_key, shares_key, grabs_key, dropped_key}) do
  redis.call('PEXPIREAT', key, expire_at)
end
return {left, redis.call('HLEN', grabs_key), redis.call('LRANGE', dropped_key, 0, -1)}
