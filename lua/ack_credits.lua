-- Settle credits a worker has committed to the database (or recorded as refused), in one call on the
-- shard's slot: take them off the shard's outbox (acknowledged and deleted), and make Redis agree with
-- the ledger about each paid share: out of its packet's list, held by its grabber. A repair that ran
-- while the credit was in flight, after Redis lost its grab, may have put the share back in the list
-- (it waits for the packet's row lock, so the credit commits after it): the share must not be handed
-- out again.
-- Its caller builds KEYS and ARGV by name: server/store/scriptcalls.py, AckCreditsCall.
local outbox_key = KEYS[1]     -- the shard's credit outbox; then, per packet with paid credits, its meta
                               -- hash, its shares list and its grabs hash (KEYS[2..])
local consumer_group = ARGV[1]
local n = tonumber(ARGV[2])    -- entry ids, ARGV[3..2+n]; then per packet in KEYS order: how many paid
                               -- credits m, then m times: user, 'seq:amount', grabbed_ms
-- Returns how many entries were acknowledged.
local acked = 0
if n > 0 then
  local ids = {unpack(ARGV, 3, 2 + n)}
  acked = redis.call('XACK', outbox_key, consumer_group, unpack(ids))
  redis.call('XDEL', outbox_key, unpack(ids))
end
local i = 3 + n
for k = 2, #KEYS, 3 do
  local meta, shares, grabs = KEYS[k], KEYS[k + 1], KEYS[k + 2]
  local m = tonumber(ARGV[i]); i = i + 1
  -- Only while the packet lives in Redis (its keys carry their expiry): nothing is made for one gone.
  local expires_at = redis.call('PEXPIRETIME', meta)
  for _ = 1, m do
    local user, share, ms = ARGV[i], ARGV[i + 1], ARGV[i + 2]; i = i + 3
    local record = share .. ':' .. ms
    local held = redis.call('HGET', grabs, user)
    -- As it should be (one read): Redis holds the grab that was paid. Otherwise a repair rebuilt the
    -- packet without it, and the share may be back in the list.
    if held ~= record and expires_at > 0 then
      redis.call('LREM', shares, 0, share)
      if not held then
        redis.call('HSET', grabs, user, record)
        redis.call('PEXPIREAT', grabs, expires_at)
      end
    end
  end
end
return acked
