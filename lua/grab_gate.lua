-- The checks before a grab that are about the user, not the packet: a block set by the bot detector,
-- and a token bucket of grab attempts shared by every hub.
-- KEYS[1] the user's block key, KEYS[2] the user's grab bucket, KEYS[3] the user's throttle (same hash tag)
-- ARGV[1] tokens per second, ARGV[2] bucket size (a throttle set by the bot detector lowers the rate)
-- Returns {'ok'} | {'blocked', ttl_ms} | {'limited', ms until a token}
local ttl = redis.call('PTTL', KEYS[1])
if ttl ~= -2 then
  return {'blocked', ttl}
end
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local throttle = redis.call('GET', KEYS[3])
if throttle then
  rate = math.min(rate, tonumber(throttle))
  burst = 1
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local b = redis.call('HMGET', KEYS[2], 'tokens', 'ms')
local tokens, last = tonumber(b[1]) or burst, tonumber(b[2]) or now
tokens = math.min(burst, tokens + (now - last) * rate / 1000)
local result
if tokens >= 1 then
  tokens = tokens - 1
  result = {'ok'}
else
  result = {'limited', math.ceil((1 - tokens) * 1000 / rate)}
end
redis.call('HSET', KEYS[2], 'tokens', tostring(tokens), 'ms', now)
redis.call('PEXPIRE', KEYS[2], math.ceil(burst * 1000 / rate) + 1000)
return result
