-- Enqueue an arq job unless one with this id is queued or has a kept result: arq's own enqueue
-- (WATCH, EXISTS, MULTI, PSETEX, ZADD, EXEC) in one atomic call, so it can ride in a pipeline.
-- The queue lives on a standalone Redis, as arq requires; these keys are not in one cluster slot.
-- KEYS[1] job key, KEYS[2] result key, KEYS[3] queue sorted set
-- ARGV[1] job id, ARGV[2] serialized job, ARGV[3] score (unix ms), ARGV[4] job key TTL (ms)
-- Returns 1 when queued now, 0 when it was there already.
if redis.call('EXISTS', KEYS[1], KEYS[2]) > 0 then
  return 0
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
return 1
