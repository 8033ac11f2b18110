-- Close a packet to grabs and read who grabbed it, in one atomic call on the packet's slot: the first
-- step of its refund. No grab can start after this call, so every grab the refund must pay is in the
-- answer (and in the shard's outbox). Made durable like a grab before the refund goes on.
-- KEYS[1] meta hash, KEYS[2] grabs hash, KEYS[3] the grabs repairs dropped
-- ARGV[1] '1' to close, '0' only to read (the sweeper); ARGV[2] expire-at (unix ms) of a meta hash made
-- by the close itself (the packet's keys were gone: grab.lua then answers it as unknown, and the
-- repair that follows keeps it closed)
-- Returns {present, grabs as user, 'seq:amount:ms', ..., dropped as 'user:seq:amount:ms', ...}:
-- present is 1 when the packet's keys were in Redis (its meta names its group), else 0 — then the
-- grabs read here are not all it had: its credits may still wait in the outbox.
local present = redis.call('HEXISTS', KEYS[1], 'group')
if ARGV[1] == '1' then
  redis.call('HSET', KEYS[1], 'closed', '1')
  if redis.call('PTTL', KEYS[1]) < 0 then
    redis.call('PEXPIREAT', KEYS[1], ARGV[2])
  end
elseif present == 1 then
  -- A write (its value unused), so that the durability wait after this call covers every grab read.
  redis.call('HINCRBY', KEYS[1], 'reads', 1)
end
return {present, redis.call('HGETALL', KEYS[2]), redis.call('LRANGE', KEYS[3], 0, -1)}
