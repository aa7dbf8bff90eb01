-- One request's hits, evaluated in one atomic call on Redis time.
--
-- KEYS[i] is hit i's key (all of them share one slot when there are several). ARGV: mode,
-- nonce, deadline, then 7 values per hit: algorithm, limit, window seconds, burst, cost, a lease
-- ('+<id>' taken, '-<id>' given back, '' none: concurrency limits only), and a last value
-- that is the role ('e' enforce, 's' shadow, 'q' quota) or, in 'refund' mode, the stamp the
-- charging call replied. A lease given back always applies: its request is over. A refund
-- passes every hit of the charging call, in the same order (members are named after their
-- index), with cost 0 for the hits that were not charged.
--
-- After the hits, one optional value: the time to decide at (us since the epoch) instead of
-- Redis TIME. Only the differential tests pass it (`RedisBackend::evaluate_at`); the server's
-- calls never do, and no part of a request can add it: the slot's position follows from the
-- number of KEYS, and a request's data only ever fills the 7 slots of its hits.
--
-- Modes. 'atomic': charge the admitted hits only if the request as a whole passes (no
-- enforced hit refused, and not every quota hit refused). 'each': charge every admitted hit
-- regardless (the reference's behaviour; also the reservation step across Cluster slots).
-- 'check': charge nothing (a request already refused elsewhere). 'refund': undo what an 'each'
-- call with the same nonce charged.
--
-- Hits are evaluated in order, each seeing the ones before it (the same descriptor twice:
-- remaining 2, then 1): an admitted hit is charged at once, and its charge undone at the end
-- when the request is not to be charged.
--
-- The deadline is when the caller stops waiting, in microseconds on Redis' clock (0: none).
-- A decision that starts past it is taken by nobody's answer: the script then charges nothing
-- and replies only the time (a refund has no deadline: it must always apply).
--
-- Replies 4 integers per hit: admitted (1/0), remaining, microseconds until reset (admitted)
-- or retry (refused), and a stamp identifying where the charge went; then, always last, the
-- script's time (microseconds), from which turnstile learns Redis' clock.
local mode, nonce, deadline = ARGV[1], ARGV[2], tonumber(ARGV[3])
local now = tonumber(ARGV[4 + #KEYS * 7])
if not now then
  local now_parts = redis.call('TIME')
  now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
end
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
  -- Last charge first, so two charges of one key are undone in the reverse of their order.
  for i = #hits, 1, -1 do
    local h = hits[i]
    if h.hits > 0 then
      h.algorithm.refund(h, now)
    end
  end
  return {now}
end

local verdicts, charged = {}, {}
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
  if string.sub(h.lease, 1, 1) == '-' then
    h.algorithm.commit(h, now, v)
  elseif v.admitted and h.hits > 0 then
    h.algorithm.commit(h, now, v)
    charged[#charged + 1] = i
  end
end

local charge = mode == 'each'
  or (mode == 'atomic' and not (enforced_refused or (quota_seen and quota_all_refused)))
if not charge then
  for c = #charged, 1, -1 do
    local i = charged[c]
    hits[i].algorithm.undo(hits[i], now, verdicts[i])
  end
end
local reply = {}
for i = 1, #hits do
  local v = verdicts[i]
  reply[#reply + 1] = v.admitted and 1 or 0
  reply[#reply + 1] = v.remaining
  reply[#reply + 1] = v.reset
  reply[#reply + 1] = v.stamp or 0
end
reply[#reply + 1] = now
return reply
