-- Several requests' hits, each request decided on its own and atomically, in one call on
-- Redis time. Requests that arrive together share a call (`coalesce.rs`): one call's fixed
-- cost is spread over them.
--
-- KEYS are every request's hits' keys, request after request (all of them share one slot).
-- ARGV: the number of requests, then per request its mode, nonce, deadline and number of
-- hits, then 8 values per hit: algorithm, limit, window seconds, burst, cost, a lease ('+<id>'
-- taken, '-<id>' given back, '' none: concurrency limits only), the role ('e' enforce, 's'
-- shadow, 'q' quota), and the stamp the charging call replied ('' except in 'refund' mode).
-- A lease given back always applies: its request is over. A refund passes every hit
-- of the charging call, in the same order (members are named after their index), with cost 0
-- for the hits that were not charged.
--
-- After the last request, one optional value: the time to decide at (us since the epoch)
-- instead of Redis TIME. Only the differential tests pass it (`RedisBackend::evaluate_at`);
-- the server's calls never do, and no request can add it: its slot follows the last request,
-- and a request's data only ever fills the slots its own counts announce.
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
local requests, a, k = {}, 1, 0
for r = 1, tonumber(ARGV[1]) do
  local request = {
    mode = ARGV[a + 1],
    nonce = ARGV[a + 2],
    deadline = tonumber(ARGV[a + 3]),
    hits = {},
  }
  local count = tonumber(ARGV[a + 4])
  a = a + 4
  for i = 1, count do
    k = k + 1
    request.hits[i] = {
      key = KEYS[k],
      algorithm = ALGORITHMS[ARGV[a + 1]],
      limit = tonumber(ARGV[a + 2]),
      window = tonumber(ARGV[a + 3]),
      burst = tonumber(ARGV[a + 4]),
      hits = tonumber(ARGV[a + 5]),
      lease = ARGV[a + 6],
      role = ARGV[a + 7],
      stamp = ARGV[a + 8],
      member = request.nonce .. ':' .. i,
    }
    a = a + 8
  end
  requests[r] = request
end
if k ~= #KEYS then
  error('the requests name ' .. k .. ' hits for ' .. #KEYS .. ' keys')
end
local now = tonumber(ARGV[a + 1])
if not now then
  local now_parts = redis.call('TIME')
  now = tonumber(now_parts[1]) * 1000000 + tonumber(now_parts[2])
end

local function refund(hits)
  -- Last charge first, so two charges of one key are undone in the reverse of their order.
  for i = #hits, 1, -1 do
    local h = hits[i]
    if h.hits > 0 then
      h.algorithm.refund(h, now)
    end
  end
end

local function decide(mode, hits, reply)
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
  for i = 1, #hits do
    local v = verdicts[i]
    reply[#reply + 1] = v.admitted and 1 or 0
    reply[#reply + 1] = v.remaining
    reply[#reply + 1] = v.reset
    reply[#reply + 1] = v.stamp or 0
  end
end

local reply = {}
for _, request in ipairs(requests) do
  if request.mode == 'refund' then
    refund(request.hits)
    reply[#reply + 1] = 1
  elseif request.deadline > 0 and now > request.deadline then
    reply[#reply + 1] = 0
  else
    reply[#reply + 1] = 1
    decide(request.mode, request.hits, reply)
  end
end
reply[#reply + 1] = now
return reply
