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
--   3. the limit specs, in one text: per spec its algorithm, limit, window seconds, burst
--      and role ('e' enforce, 's' shadow, 'q' quota), separated by spaces and ended by ';'.
--      A call sends each distinct spec once, however many of its hits use it;
--   4. the number of runs, a run being requests in a row alike in mode and hits (most of
--   a call's requests make one run), then per run:
--   - its shape: its mode's letter ('a' atomic, 'e' each, 'c' check, 'r' refund), then per
--     hit ' <spec index, from 1>:<cost>', plus 'P' when the hit carries a permit, then
--     '*<how many requests the run holds>'; read once per call however often it recurs;
--   - then its requests' tickets, in one value: per request, in order, 28 characters, its
--     nonce (12 alphanumerics) then its deadline (16 digits; all zeros: none), read only
--     where needed (the nonce names sliding-window entries and spreads expiries, the
--     deadline matters to a call started late);
--   - then per request of the run, per hit, in order, its permit if it carries one ('+<id>'
--     taken, '-<id>' given back: concurrency limits only), and in a refund the stamp the
--     charging call replied (most runs: nothing).
--   Every value a call carries costs Redis about as much as a small decision's Lua, so what
--   requests share travels in text they share, once per run, and their tickets together.
-- A permit given back always applies: its request is over. A refund passes every hit of the
-- charging call, in the same order (members are named after their index), with cost 0 for
-- the hits that were not charged. The call's layout is checked before anything is written.
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
-- Replies, per request: per hit its remaining when admitted or -1 - remaining when refused,
-- and the microseconds until reset (admitted) or retry (refused), plus, in 'each' mode only,
-- a stamp identifying where the charge went (what a refund needs); or false (nil to the
-- caller) alone for a request past its deadline; nothing for a refund. Then, always last,
-- the script's time (microseconds), from which turnstile learns Redis' clock.
--
-- All of this runs for every decision on Redis' one thread, so the work per hit is kept
-- small: no table is made per hit or per verdict, and numbers go to Redis as the text they
-- came in or were formatted in once per call.
-- A ticket's length, and its nonce's: a request's ticket starts after `o` characters of its
-- run's tickets, o = (its place in the run - 1) * TICKET.
local TICKET, NONCE = 28, 12

-- What calls read of their specs' text and their runs' shapes (about a quarter of a call of
-- one request), by the texts themselves. A function library keeps it, as it keeps the twins:
-- there the code above the line that opens each call runs once (twins.rs); a script reads
-- anew in every call. It is bounded by characters (each entry counted as its text's length
-- and ENTRY more): past KEEP, everything is forgotten and read again.
local read, kept = {}, 0
local KEEP, ENTRY = 65536, 256

-- Each call: (a library's code can reach Redis' and Lua's libraries only from here on)
local ARGV, KEYS, byte, sub = ARGV, KEYS, string.byte, string.sub
local match, gmatch = string.match, string.gmatch
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

-- Twins an earlier call made (a function library keeps them: twins.rs) forget what it left
-- (`begin`), even if an error ended it. A script makes them afresh: none here yet.
every_twin('begin')

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

-- The specs: what was read of their text, or read now. A spec's table outlives the call where
-- a library keeps it; each call's `prepare` works out what all its hits share in that call.
local specs_text = ARGV[3]
if kept > KEEP then
  read, kept = {}, 0
end
local known = read[specs_text]
if not known then
  local specs, length = {}, 0
  for whole, name, limit, window, burst, role in
      gmatch(specs_text, '(([%w_]+) (%d+) (%d+) (%d+) (%a);)') do
    local twin = ALGORITHMS[name] or algorithm(name)
    length = length + #whole
    specs[#specs + 1] = {
      twin = twin,
      prepare = twin.prepare,
      take = twin.take,
      limit = numbers[limit] or number(limit),
      window = numbers[window] or number(window),
      burst = numbers[burst] or number(burst),
      role = role,
    }
  end
  if length ~= #specs_text then
    error('the specs are written ' .. specs_text)
  end
  known = { specs = specs, shapes = {} }
  read[specs_text], kept = known, kept + #specs_text + ENTRY
end
local specs = known.specs
for s = 1, #specs do
  local spec = specs[s]
  spec.prepare(spec, now)
end

-- Every key must be some hit's, and every value some field's; each run's shape is read here,
-- the first time a call with these specs meets its text (and kept with them), into what its
-- requests share, as one flat table (a table per field, or a function to read it, would cost
-- more): its mode's letter, hit count, how many values follow each ticket and how many
-- requests the run holds, then per hit its spec, cost and cost's text; and, only where some
-- hit has one, where each hit's permit (`permit`) and stamp (`stamp`) are among those values
-- (nil: none). The commonest shape, one hit without a permit outside a refund, is read by one
-- match; where that hit costs something and its requests charge (atomic or each), the shape
-- names the hit's spec as `quick`. A shape is kept only once it is checked whole.
local shapes = known.shapes
local a = 4
local runs, first, k = numbers[ARGV[a]] or number(ARGV[a]), a, 0
for _ = 1, runs do
  local text = ARGV[a + 1]
  local sh = shapes[text]
  if not sh then
    local letter, index, cost, size = match(text, '^([aec]) (%d+):(%d+)%*(%d+)$')
    if letter then
      local spec = specs[numbers[index] or number(index)]
      sh = { letter, 1, 0, spec, numbers[cost] or number(cost), cost }
      sh.size = numbers[size] or number(size)
      if spec and sh[5] > 0 and letter ~= 'c' then
        sh.quick = spec
      end
    else
      letter = match(text, '^[aecr]')
      size = match(text, '%*(%d+)$')
      sh = { letter, 0, 0 }
      local permits, stamps, count, extras, length = {}, {}, 0, 0, 1
      for hit, index, cost, has_permit in gmatch(text, '( (%d+):(%d+)(P?))') do
        count, length = count + 1, length + #hit
        sh[3 * count + 1] = specs[numbers[index] or number(index)] or false
        sh[3 * count + 2], sh[3 * count + 3] = numbers[cost] or number(cost), cost
        if has_permit == 'P' then
          extras = extras + 1
          permits[count], sh.permit = extras, permits
        end
        if letter == 'r' then
          extras = extras + 1
          stamps[count], sh.stamp = extras, stamps
        end
      end
      if not (letter and size) or length + 1 + #size ~= #text then
        error('a run is shaped ' .. text)
      end
      sh[2], sh[3], sh.size = count, extras, numbers[size] or number(size)
    end
    for i = 1, sh[2] do
      if not sh[3 * i + 1] then
        error('a run is shaped ' .. text .. ': it names a spec the call has not')
      end
    end
    if sh.size < 1 then
      error('a run is shaped ' .. text .. ': it holds no request')
    end
    shapes[text], kept = sh, kept + #text + ENTRY
  end
  if #(ARGV[a + 2] or '') ~= sh.size * TICKET then
    error('a run is shaped ' .. text .. ': its tickets are not ' .. sh.size .. ' of '
      .. TICKET .. ' characters')
  end
  k = k + sh.size * sh[2]
  a = a + 2 + sh.size * sh[3]
end
if k ~= #KEYS or a ~= #ARGV then
  error('the call names ' .. k .. ' hits for ' .. #KEYS .. ' keys, and ' .. a .. ' of '
    .. #ARGV .. ' values')
end

-- A twin keeps in a hit's table what its later steps need. The current request's tables, by
-- hit position, are reused by the next request (its hits are done with by then) rather than
-- made per hit, and made only for the hits that need one; likewise the list of the request's
-- charged hits (their positions).
local hits, charged = {}, {}

-- The request's i-th hit's table, filled from its shape `sh`, its values after ARGV position
-- at, its key KEYS[key + i] and its ticket (after `o` characters of `tickets`); the text of
-- its cost goes to Redis as it came (Redis parses it cheaply), the number to Lua.
local function load(sh, i, at, key, tickets, o)
  local h = hits[i]
  if not h then
    h = {}
    hits[i] = h
  end
  local permits, j = sh.permit, 3 * i
  h.key, h.spec, h.cost, h.cost_text, h.index = KEYS[key + i], sh[j + 1], sh[j + 2],
    sh[j + 3], i
  h.permit = permits and permits[i] and ARGV[at + permits[i]] or '0'
  if h.spec.twin.named then
    h.nonce = sub(tickets, o + 1, o + NONCE)
  end
  return h
end

-- Each request is decided here, inline: a function call per request costs more. A hit that
-- costs something and holds no permit goes to its twin's `take` where it has one, given its
-- values as they are: no table is filled for it unless the twin declines it (returns
-- nothing) or its charge is undone. A `quick` request, most of a busy call's, is its one
-- hit's `take` (or check, then commit if admitted) and nothing more: the hit is charged
-- exactly when admitted, as the loop below would (it undoes a request's charges only when
-- one of its hits is refused, and a lone refused hit has charged nothing), so there is
-- nothing to undo and the reply is the hit's.
local reply, n = {}, 0
a, k = first, 0
for _ = 1, runs do
  local sh, tickets = shapes[ARGV[a + 1]], ARGV[a + 2]
  local mode, count, extras, quick = sh[1], sh[2], sh[3], sh.quick
  a = a + 2
  for o = 0, (sh.size - 1) * TICKET, TICKET do
    -- The request's values follow ARGV position at; its i-th hit's key is KEYS[key + i]; its
    -- ticket follows o characters of the run's tickets.
    local at, key = a, k
    a, k = at + extras, k + count
    -- Its deadline is read only in a call that started late (0: none, and so is one that is
    -- no number).
    local deadline = late and tonumber(sub(tickets, o + NONCE + 1, o + TICKET))
    if mode == 'r' then
      local stamps = sh.stamp
      for i = 1, count do
        load(sh, i, at, key, tickets, o).stamp = ARGV[at + stamps[i]]
      end
      -- Last charge first, so two charges of one key are undone in the reverse of their
      -- order.
      for i = count, 1, -1 do
        local h = hits[i]
        if h.cost > 0 then
          h.spec.twin.refund(h.spec, h, now)
        end
      end
    elseif deadline and deadline > 0 and now > deadline and count > 0 then
      n = n + 1
      reply[n] = false
    elseif quick then
      local take, admitted, remaining, reset, stamp = quick.take
      if take then
        admitted, remaining, reset, stamp = take(quick, KEYS[key + 1], sh[5], sh[6], tickets, o)
      end
      if admitted == nil then
        local h, twin = load(sh, 1, at, key, tickets, o), quick.twin
        admitted, remaining, reset, stamp = twin.check(quick, h, now)
        if admitted then
          twin.commit(quick, h, now, tickets, o)
        end
      end
      reply[n + 1] = admitted and remaining or -1 - remaining
      reply[n + 2] = reset
      if mode == 'e' then
        reply[n + 3] = stamp
        n = n + 3
      else
        n = n + 2
      end
    else
      local with_stamps = mode == 'e'
      local charges, enforced_refused, quota_seen, quota_admitted = 0, false, false, false
      local permits = sh.permit
      for i = 1, count do
        local j = 3 * i
        local s, cost = sh[j + 1], sh[j + 2]
        local has_permit, take, admitted, remaining, reset, stamp, took = permits and permits[i], s.take
        if take and cost > 0 and not has_permit then
          admitted, remaining, reset, stamp = take(s, KEYS[key + i], cost, sh[j + 3], tickets, o)
          took = admitted
        end
        if admitted == nil then
          local h, twin = load(sh, i, at, key, tickets, o), s.twin
          admitted, remaining, reset, stamp = twin.check(s, h, now)
          if has_permit and byte(h.permit) == GIVE then
            twin.commit(s, h, now, tickets, o)
          elseif admitted and cost > 0 then
            twin.commit(s, h, now, tickets, o)
            took = true
          end
        end
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
        reply[n + 1] = admitted and remaining or -1 - remaining
        reply[n + 2] = reset
        if with_stamps then
          reply[n + 3] = stamp
          n = n + 3
        else
          n = n + 2
        end
      end
      if charges > 0 and not (mode == 'e'
          or (mode == 'a' and not enforced_refused and (quota_admitted or not quota_seen))) then
        for c = charges, 1, -1 do
          local h = load(sh, charged[c], at, key, tickets, o)
          h.spec.twin.undo(h.spec, h, now)
        end
      end
    end
  end
end
-- What a twin deferred within the call is written now (`finish`).
every_twin('finish')
reply[n + 1] = now
return reply
