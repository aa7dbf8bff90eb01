-- The batch driver: several requests' hits in one call on Redis time, each request decided
-- on its own and atomically (requests that arrive together share a call: coalesce.rs).
--
-- Words, as on the Rust side (script.rs):
--   spec    a limit as a call sends it: '<algorithm> <limit> <window s> <burst> <role>;'
--   role    'e' enforce (a refusal refuses the request), 's' shadow, 'q' quota
--   mode    what a request charges (Rust `Mode`, from `Charging`): 'a' atomic (its admitted
--           hits, only if it passes), 'p' per descriptor (every admitted hit: the reference's
--           way, and the reservation step across Cluster slots), 'c' check (nothing),
--           'r' refund (undo a 'p' call with the same nonce)
--   run     requests in a row alike in mode and hits; its shape, read once per call, is the
--           mode's letter, ' <spec index>:<cost>' per hit ('P' after it: it carries a
--           permit), then '*<requests in the run>'
--   ticket  a request's nonce (12 alphanumerics: names its sliding-window entries) and
--           deadline (16 digits, us on Redis' clock; zeros: none)
--   permit  a concurrency limit's hold on one request: '+<id>' taken, '-<id>' given back
--   stamp   where a 'p' call's charge went: what its refund passes back
--
-- KEYS: every request's hits' keys, in order (one slot). ARGV: now (us; '0': Redis TIME),
-- the earliest deadline ('0': none), the specs, the number of runs, then per run its shape,
-- its requests' tickets in one value, then per request its permits and, in a refund, stamps.
-- What requests share travels once per run: every value costs Redis about a small decision.
--
-- Hits are decided in order, each seeing those before it; a request not to be charged has
-- its charges undone before the next, so each request is decided as if alone. A request
-- past its deadline is decided for nobody and charges nothing. Reply per request: per hit
-- its remaining (-1 - remaining if refused) and us until reset or retry, plus its stamp in
-- mode 'p'; nil alone past its deadline; nothing for a refund. Last, the script's time.
--
-- `batch` is each call. A function library makes everything above it once and keeps it; a
-- script runs it all on every call, `batch`'s body at the top level (twins.rs).

-- A ticket's length, and its nonce's: a request's ticket starts after `o` characters of its
-- run's tickets, o = (its place in the run - 1) * TICKET.
local TICKET, NONCE = 28, 12

-- What calls read of their specs' text and their runs' shapes, by the texts themselves. A
-- function library keeps it between calls, as it keeps the twins; a script reads anew in
-- every call. It is bounded by characters (each entry counted as its text's length
-- and ENTRY more): past KEEP, everything is forgotten and read again.
local read, kept = {}, 0
local KEEP, ENTRY = 65536, 256

-- Each call. Redis' and Lua's libraries can be reached only from in here when kept by a
-- function library.
local function batch(KEYS, ARGV)
  local byte, sub = string.byte, string.sub
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
      local letter, index, cost, size = match(text, '^([apc]) (%d+):(%d+)%*(%d+)$')
      if letter then
        local spec = specs[numbers[index] or number(index)]
        sh = { letter, 1, 0, spec, numbers[cost] or number(cost), cost }
        sh.size = numbers[size] or number(size)
        if spec and sh[5] > 0 and letter ~= 'c' then
          sh.quick = spec
        end
      else
        letter = match(text, '^[apcr]')
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
        if mode == 'p' then
          reply[n + 3] = stamp
          n = n + 3
        else
          n = n + 2
        end
      else
        local with_stamps = mode == 'p'
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
        if charges > 0 and not (mode == 'p'
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
end
