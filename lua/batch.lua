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
local ARGV, KEYS, byte = ARGV, KEYS, string.byte
local GIVE = byte('-')

-- A text becomes a number through strtod; the same few texts (costs, counts, spec indices)
-- recur throughout a call, so each is converted once: `numbers[text] or number(text)` (a
-- metatable's __index would cost more). The commonest come converted. Arithmetic converts
-- a text once, where tonumber converts it twice; a text that is no number is an error
-- either way.
local numbers = { ['0'] = 0, ['1'] = 1 }
local function number(text)
  local value = text + 0
  numbers[text] = value
  return value
end

-- Every key must be some hit's, and every value some field's.
local spec_count = numbers[ARGV[3]] or number(ARGV[3])
local a = 3 + 5 * spec_count + 1
local requests, first, k = numbers[ARGV[a]] or number(ARGV[a]), a, 0
for _ = 1, requests do
  local text = ARGV[a + 4]
  local count = numbers[text] or number(text)
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
  now = now_parts[1] * 1000000 + now_parts[2]
else
  now = ARGV[1] + 0
end
-- Only a call that starts past its earliest deadline reads the requests' own.
local late = ARGV[2] ~= '0' and now > ARGV[2] + 0

-- Each spec's twin works out once what all its hits share in this call (`prepare`).
local specs = {}
for s = 1, spec_count do
  local b = 3 + 5 * (s - 1)
  local name = ARGV[b + 1]
  local twin = ALGORITHMS[name] or algorithm(name)
  local limit, window, burst = ARGV[b + 2], ARGV[b + 3], ARGV[b + 4]
  local spec = {
    twin = twin,
    take = twin.take,
    limit = numbers[limit] or number(limit),
    window = numbers[window] or number(window),
    burst = numbers[burst] or number(burst),
    role = ARGV[b + 5],
  }
  twin.prepare(spec, now)
  specs[s] = spec
end

-- A twin keeps in a hit's table what its later steps need. The current request's tables, by
-- hit position, are reused by the next request (its hits are done with by then) rather than
-- made per hit, and made only for the hits that need one; likewise the list of the request's
-- charged hits (their positions).
local hits, charged = {}, {}

-- The request's i-th hit's table, filled with the hit whose values follow ARGV position at and
-- whose key is KEYS[key]; the text of its cost goes to Redis as it came (Redis parses it
-- cheaply), the number to Lua.
local function load(i, at, key, nonce)
  local h = hits[i]
  if not h then
    h = {}
    hits[i] = h
  end
  local index, cost = ARGV[at + 1], ARGV[at + 2]
  h.key, h.cost, h.cost_text, h.lease, h.nonce, h.index =
    KEYS[key], numbers[cost] or number(cost), cost, ARGV[at + 3], nonce, i
  h.spec = specs[numbers[index] or number(index)] or error('no spec ' .. index)
  return h
end

-- Each request is decided here, inline: a function call per request costs more. A hit that
-- costs something and holds no lease goes to its twin's `take` where it has one, given its
-- values as they are: no table is filled for it unless the twin declines it (returns
-- nothing) or its charge is undone.
local reply, n = {}, 0
a, k = first, 0
for _ = 1, requests do
  local mode, nonce, count = ARGV[a + 1], ARGV[a + 2], numbers[ARGV[a + 4]]
  local deadline = late and ARGV[a + 3] + 0
  -- The request's i-th hit's values follow ARGV position at + 3 * (i - 1); its key is
  -- KEYS[key + i].
  local at, key = a + 4, k
  a = at
  n = n + 1
  if mode == 'refund' then
    for i = 1, count do
      load(i, a, k + i, nonce).stamp = ARGV[a + 4]
      a = a + 4
    end
    k = k + count
    -- Last charge first, so two charges of one key are undone in the reverse of their order.
    for i = count, 1, -1 do
      local h = hits[i]
      if h.cost > 0 then
        h.spec.twin.refund(h.spec, h, now)
      end
    end
    reply[n] = 1
  elseif deadline and deadline > 0 and now > deadline then
    a, k = a + 3 * count, k + count
    reply[n] = 0
  else
    reply[n] = 1
    local charges, enforced_refused, quota_seen, quota_admitted = 0, false, false, false
    for i = 1, count do
      local index, cost_text = ARGV[a + 1], ARGV[a + 2]
      local s = specs[numbers[index] or number(index)] or error('no spec ' .. index)
      local cost = numbers[cost_text] or number(cost_text)
      local lease, take, admitted, remaining, reset, stamp, took = ARGV[a + 3], s.take
      k = k + 1
      if take and cost > 0 and lease == '0' then
        admitted, remaining, reset, stamp = take(s, KEYS[k], cost, cost_text)
        took = admitted
      end
      if admitted == nil then
        local h, twin = load(i, a, k, nonce), s.twin
        admitted, remaining, reset, stamp = twin.check(s, h, now)
        -- Comparing texts costs less than calling byte; most hits hold no lease.
        if lease ~= '0' and byte(lease) == GIVE then
          twin.commit(s, h, now)
        elseif admitted and cost > 0 then
          twin.commit(s, h, now)
          took = true
        end
      end
      a = a + 3
      if took then
        charges = charges + 1
        charged[charges] = i
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
        local i = charged[c]
        local h = load(i, at + 3 * (i - 1), key + i, nonce)
        h.spec.twin.undo(h.spec, h, now)
      end
    end
  end
end
reply[n + 1] = now
return reply
