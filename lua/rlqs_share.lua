-- RLQS: one Envoy's share of a bucket's limit, reserved atomically. KEYS[1] is a hash with one
-- field per holder (a bucket of an Envoy stream): "<demand> <share> <expires at, ms>". ARGV:
-- holder id, demand per window (negative: the holder left), limit, idle weight, hysteresis,
-- ttl (ms). Replies the
-- share. Expired fields are dropped as they are met; the hash expires with its last writer.
-- Mirrors src/rlqs/share.rs (assign).
local id = ARGV[1]
local demand, limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local idle, hysteresis, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

if demand < 0 then
  redis.call('HDEL', KEYS[1], id)
  return 0
end

local weight, reserved, held = 0, 0, nil
local fields = redis.call('HGETALL', KEYS[1])
for i = 1, #fields, 2 do
  local d, s, e = string.match(fields[i + 1], '^(%S+) (%S+) (%S+)$')
  if not e or tonumber(e) <= now then
    redis.call('HDEL', KEYS[1], fields[i])
  elseif fields[i] == id then
    held = tonumber(s)
  else
    weight = weight + tonumber(d) + idle
    reserved = reserved + tonumber(s)
  end
end

local own = demand + idle
local target = math.floor(limit * own / (own + weight) + 1e-9)
local free = math.max(limit - reserved, 0)
local share
if held and held <= math.min(free, target) and target - held <= target * hysteresis then
  share = held
else
  share = math.min(target, free)
end
redis.call('HSET', KEYS[1], id, string.format('%.3f %d %d', demand, share, now + ttl))
redis.call('PEXPIRE', KEYS[1], ttl)
return share
