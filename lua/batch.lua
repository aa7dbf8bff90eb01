-- One request's hits, evaluated in one atomic call on Redis time.
--
-- KEYS[i] is hit i's key (all of them share one slot when there are several). ARGV: mode,
-- nonce, deadline, then 7 values per hit: algorithm, limit, window seconds, burst, cost, a lease
-- ('+<id>' taken, '-<id>' given back, '' none: concurrency limits only), and a last value
-- that is the role ('e' enforce, 's' shadow, 'q' quota) or, in 'refund' mode, the stamp the
-- charging call replied. A lease given back always applies: its request is over. A refund passes every hit of the charging call, in the same
-- order (members are named after their index), with cost 0 for the hits that were not charged.
--
-- Modes. 'atomic': check every hit, then charge the admitted ones only if the request as a
-- whole passes (no enforced hit refused, and not every quota hit refused). 'each': charge
-- every admitted hit regardless (the reference's behaviour; also the reservation step
-- across Cluster slots). 'refund': undo what an 'each' call with the same nonce charged.
--
-- The deadline is when the caller stops waiting, in microseconds on Redis' clock (0: none).
-- A decision that starts past it is taken by nobody's answer: the script then charges nothing
-- and replies only the time (a refund has no deadline: it must always apply).
--
-- Replies 4 integers per hit: admitted (1/0), remaining, microseconds until reset (admitted)
-- or retry (refused), and a stamp identifying where the charge went; then, always last, the
-- script's time (TIME, microseconds), from which turnstile learns Redis' clock.
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
local mode, nonce, deadline = ARGV[1], ARGV[2], tonumber(ARGV[3])
if mode ~= 'refund' and deadline > 0 and now > deadline then
  return {now}
end

local hits = {}
for i = 1, #KEYS do
  local a = 3 + (i - 1) * 7
  hits[i] = {
    key = KEYS[i],
    algorithm = ALGORITHMS[ARGV[a + 1]],
    limit = tonumber(ARGV[a + 2]),
    window = tonumber(ARGV[a + 3]),
    burst = tonumber(ARGV[a + 4]),
    hits = tonumber(ARGV[a + 5]),
    lease = ARGV[a + 6],
    role = ARGV[a + 7],
    stamp = ARGV[a + 7],
    member = nonce .. ':' .. i,
  }
end

if mode == 'refund' then
  for _, h in ipairs(hits) do
    if h.hits > 0 then
      h.algorithm.refund(h, now)
    end
  end
  return {now}
end

local verdicts = {}
local enforced_refused, quota_seen, quota_all_refused = false, false, true
for i, h in ipairs(hits) do
  local v = h.algorithm.check(h, now)
  verdicts[i] = v
  if h.role == 'e' and not v.admitted then
    enforced_refused = true
  elseif h.role == 'q' then
    quota_seen = true
    quota_all_refused = quota_all_refused and not v.admitted
  end
end

local charge = mode == 'each' or not (enforced_refused or (quota_seen and quota_all_refused))
local reply = {}
for i, h in ipairs(hits) do
  local v = verdicts[i]
  if string.sub(h.lease, 1, 1) == '-' or (charge and v.admitted and h.hits > 0) then
    h.algorithm.commit(h, now, v)
  end
  reply[#reply + 1] = v.admitted and 1 or 0
  reply[#reply + 1] = v.remaining
  reply[#reply + 1] = v.reset
  reply[#reply + 1] = v.stamp or 0
end
reply[#reply + 1] = now
return reply
