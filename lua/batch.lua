-- Several requests' hits, each request decided on its own and atomically, in one call on
-- Redis time. Requests that arrive together share a call (`coalesce.rs`): one call's fixed
-- cost is spread over them.
--
-- KEYS are every request's hits' keys, request after request (all of them share one slot).
-- ARGV:
--   1. the time to decide at (us since the epoch), or 0: Redis TIME. Only the differential
--      tests pass a time (`RedisBackend::evaluate_at`); the server's calls never do. It
--      comes first, where no request's data can stand in for it;
--   2. the earliest of the requests' deadlines (0: none), so a call that starts before it
--      reads none of them;
--   3. the number of limit specs, then 5 values per spec: algorithm, limit, window seconds,
--      burst, and the role ('e' enforce, 's' shadow, 'q' quota). A call sends each distinct
--      spec once, however many of its hits use it;
--   then the number of requests, then per request its mode, nonce, deadline and number of
--   hits, then per hit: its spec's index (from 1), cost, and lease ('+<id>' taken, '-<id>'
--   given back, '0' none: concurrency limits only), plus, in 'refund' mode only, the stamp
--   the charging call replied.
-- A lease given back always applies: its request is over. A refund passes every hit of the
-- charging call, in the same order (members are named after their index), with cost 0 for
-- the hits that were not charged. The call's shape is checked before anything is written.
--
-- Modes. 'atomic': charge the admitted hits only if the request as a whole passes (no
-- enforced hit refused, and not every quota hit refused). 'each': charge every admitted hit
-- regardless (the reference's behaviour; also the reservation step across Cluster slots).
-- 'check': charge nothing (a request already refused elsewhere). 'refund': undo what an 'each'
-- call with the same nonce charged.
--
-- A request's hits are evaluated in order, each seeing the ones before it (the same
-- descriptor twice: remaining 2, then 1): an admitted hit is charged at once, and its charge
-- undone before the next request when the request is not to be charged. So a request sees
-- the requests before it in the call as charged or not, exactly as if they had been separate
-- calls, and one request's refusal never touches another's hits.
--
-- A request's deadline is when its caller stops waiting, in microseconds on Redis' clock (0:
-- none). A decision that starts past it is taken for nobody: the request charges nothing (a
-- refund has no deadline: it must always apply).
--
-- Replies, per request: 1 then 4 integers per hit (admitted 1/0, remaining, microseconds until
-- reset (admitted) or retry (refused), and a stamp identifying where the charge went); or 0
-- alone for a request past its deadline; or 1 alone for a refund. Then, always last, the
-- script's time (microseconds), from which turnstile learns Redis' clock.
--
-- All of this runs for every decision on Redis' one thread, so the work per hit is kept
-- small: no table is made per hit or per verdict, and numbers go to Redis as the text they
-- came in or were formatted in once per call.
local ARGV, KEYS, byte, tonumber = ARGV, KEYS, string.byte, tonumber
local GIVE = byte('-')

-- tonumber of a string goes through strtod; the same few texts (costs, counts, spec indices)
-- recur throughout a call, so each is converted once.
local numbers = setmetatable({}, {
  __index = function(memo, text)
    local number = tonumber(text) or error('not a number: ' .. tostring(text))
    memo[text] = number
    return number
  end,
})

-- Every key must be some hit's, and every value some field's.
local spec_count = numbers[ARGV[3]]
local a = 3 + 5 * spec_count + 1
local requests, first, k = numbers[ARGV[a]], a, 0
for _ = 1, requests do
  local count = numbers[ARGV[a + 4]]
  k = k + count
  a = a + 4 + count * (ARGV[a + 1] == 'refund' and 4 or 3)
end
if k ~= #KEYS or a ~= #ARGV then
  error('the call names ' .. k .. ' hits for ' .. #KEYS .. ' keys, and ' .. a .. ' of '
    .. #ARGV .. ' values')
end

-- The first two values are compared as text before any is parsed: parsing costs more.
local now
if ARGV[1] == '0' then
  local now_parts = redis.call('TIME')
  now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
else
  now = tonumber(ARGV[1])
end
-- Only a call that starts past its earliest deadline reads the requests' own.
local late = ARGV[2] ~= '0' and now > tonumber(ARGV[2])

-- Each spec's twin works out once what all its hits share in this call (`prepare`).
local specs = {}
for s = 1, spec_count do
  local b = 3 + 5 * (s - 1)
  local twin = ALGORITHMS[ARGV[b + 1]]
  local spec = {
    twin = twin,
    take = twin.take,
    limit = numbers[ARGV[b + 2]],
    window = numbers[ARGV[b + 3]],
    burst = numbers[ARGV[b + 4]],
    role = ARGV[b + 5],
  }
  twin.prepare(spec, now)
  specs[s] = spec
end

-- A twin keeps in a hit's table what its later steps need. The current request's tables, by
-- hit position, are reused by the next request (its hits are done with by then) rather than
-- made per hit; likewise the list of the request's charges (each one's spec and hit).
local hits, made, charged_specs, charged_hits = {}, 0, {}, {}

-- The request's i-th hit, read from ARGV at a; the text of its cost goes to Redis as it came
-- (Redis parses it cheaply), the number to Lua.
local function load(i, nonce)
  local h = hits[i]
  k = k + 1
  local cost = ARGV[a + 2]
  h.key = KEYS[k]
  h.spec = specs[numbers[ARGV[a + 1]]] or error('no spec ' .. ARGV[a + 1])
  h.cost, h.cost_text, h.lease, h.nonce, h.index = numbers[cost], cost, ARGV[a + 3], nonce, i
  return h
end

local function refund(nonce, count)
  for i = 1, count do
    load(i, nonce).stamp = ARGV[a + 4]
    a = a + 4
  end
  -- Last charge first, so two charges of one key are undone in the reverse of their order.
  for i = count, 1, -1 do
    local h = hits[i]
    if h.cost > 0 then
      h.spec.twin.refund(h.spec, h, now)
    end
  end
end

-- Decides a request into reply after its n-th value; returns the new last position. A hit
-- that costs something and holds no lease goes to its twin's `take` where it has one, given
-- its values as they are: no table is filled for it.
local function decide(mode, nonce, count, reply, n)
  local charges, enforced_refused, quota_seen, quota_admitted = 0, false, false, false
  for i = 1, count do
    local s, cost_text = specs[numbers[ARGV[a + 1]]], ARGV[a + 2]
    local cost = numbers[cost_text]
    local h, admitted, remaining, reset, stamp, charged
    if s and s.take and cost > 0 and ARGV[a + 3] == '0' then
      k = k + 1
      h = hits[i]
      admitted, remaining, reset, stamp = s.take(s, h, KEYS[k], cost, cost_text)
      charged = admitted
    else
      h = load(i, nonce)
      s = h.spec
      local twin = s.twin
      admitted, remaining, reset, stamp = twin.check(s, h, now)
      if byte(h.lease) == GIVE then
        twin.commit(s, h, now)
      elseif admitted and cost > 0 then
        twin.commit(s, h, now)
        charged = true
      end
    end
    a = a + 3
    if charged then
      charges = charges + 1
      charged_specs[charges], charged_hits[charges] = s, h
    end
    local role = s.role
    if role == 'e' then
      enforced_refused = enforced_refused or not admitted
    elseif role == 'q' then
      quota_seen = true
      quota_admitted = quota_admitted or admitted
    end
    reply[n + 1] = admitted and 1 or 0
    reply[n + 2] = remaining
    reply[n + 3] = reset
    reply[n + 4] = stamp
    n = n + 4
  end
  if charges > 0 and not (mode == 'each'
      or (mode == 'atomic' and not enforced_refused and (quota_admitted or not quota_seen))) then
    for c = charges, 1, -1 do
      charged_specs[c].twin.undo(charged_specs[c], charged_hits[c], now)
    end
  end
  return n
end

local reply, n = {}, 0
a, k = first, 0
for _ = 1, requests do
  local mode, nonce, count = ARGV[a + 1], ARGV[a + 2], numbers[ARGV[a + 4]]
  local deadline = late and tonumber(ARGV[a + 3])
  a = a + 4
  n = n + 1
  if count > made then
    for i = made + 1, count do
      hits[i] = {}
    end
    made = count
  end
  if mode == 'refund' then
    refund(nonce, count)
    reply[n] = 1
  elseif deadline and deadline > 0 and now > deadline then
    a, k = a + 3 * count, k + count
    reply[n] = 0
  else
    reply[n] = 1
    n = decide(mode, nonce, count, reply, n)
  end
end
reply[n + 1] = now
return reply
