-- Close a packet to grabs and read who grabbed it, in one atomic call on the packet's slot: the first
-- step of its refund. No grab can start after this call, so every grab the refund must pay is in the
-- answer (and in the shard's outbox). Made durable like a grab before the refund goes on.
-- Its caller builds KEYS and ARGV by name: server/store/scriptcalls.py, ClosePacketCall.
local meta_key = KEYS[1]      -- the packet's meta hash
local grabs_key = KEYS[2]     -- the packet's grabs hash
local dropped_key = KEYS[3]   -- the grabs repairs dropped (a list)
local close = ARGV[1] == '1'  -- '0' only to read (the sweeper)
local expire_at = ARGV[2]     -- expire-at (unix ms) of a meta hash made by the close itself (the packet's
                              -- keys were gone: grab.lua then answers it as unknown, and the repair that
                              -- follows keeps it closed)
-- Returns {present, grabs as user, 'seq:amount:ms', ..., dropped as 'user:seq:amount:ms', ...}:
-- present is 1 when the packet's keys were in Redis (its meta names its group), else 0 — then the
-- grabs read here are not all it had: its credits may still wait in the outbox.
local present = redis.call('HEXISTS', meta_key, 'group')
if close then
  redis.call('HSET', meta_key, 'closed', '1')
  if redis.call('PTTL', meta_key) < 0 then
    redis.call('PEXPIREAT', meta_key, expire_at)
  end
elseif present == 1 then
  -- A write (its value unused), so that the durability wait after this call covers every grab read.
  redis.call('HINCRBY', meta_key, 'reads', 1)
end
return {present, redis.call('HGETALL', grabs_key), redis.call('LRANGE', dropped_key, 0, -1)}
