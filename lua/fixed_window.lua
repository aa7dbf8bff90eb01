-- Fixed window: one counter per epoch-aligned window, named <key><separator><window start
-- seconds>. The window is computed here from Redis TIME, never from the caller's clock. The
-- counter expires after its window ends (below). Its decisions mirror
-- src/algorithm/fixed_window.rs.
--
-- The chunk is given its key layout: 'turnstile' (<key>:<window start>) or 'reference', the
-- reference server's (<prefix><domain>_<key>_<value>_..._<window start>), so both servers
-- count on the same keys during a migration.
local layout = ...
local separator = layout == 'reference' and '' or ':'
-- In turnstile's layout a counter's key names its limit's window, so the expiry its first
-- write gives it holds for every later one. The reference's keys do not: limits of one
-- descriptor with different windows can share a counter, so there every charge sets the
-- expiry again, as the reference server does.
local every_charge_expires = layout == 'reference'
local call, tonumber, format = redis.call, tonumber, string.format
local byte = string.byte
-- A window's counters must not all expire at its end: Redis deletes expired keys in cycles
-- that stall every call while they run (LATENCY LATEST: expire-cycle). Counters made at a window's start, as
-- every busy limit's are, would still expire together were they spread by when they were
-- made; so each outlives its window by an offset drawn from its request's nonce (random
-- alphanumerics), below the spread: the window, or a minute if shorter. The memory backend
-- needs none of this: its sweep visits every entry anyway.
local SPREAD_MS = 60000

-- The counter's time to live (ms): to its window's end, then the offset, from the first
-- three characters of the request's ticket (after `o` characters of `tickets`).
local function ttl(s, tickets, o)
  local a, b, c = byte(tickets, o + 1, o + 3)
  return s.ttl + (a * 7919 + b * 104729 + c * 1299709) % s.spread
end

-- A busy limit's requests follow one another in a call, on one counter: a charge on the
-- counter the last take charged or refused is decided from the count that take returned,
-- and the counter is owed it, paid in one INCRBY (`settle`) before anything else here reads
-- or writes a counter, and when the call ends (`finish`). No one else sees the counter
-- meanwhile (the call is atomic), and a run of charges on one counter costs Redis one
-- command instead of one each. Not in the reference's layout, where every charge sets the
-- expiry again.
local last, count, owed = nil, 0, 0

local function settle()
  if owed > 0 then
    call('INCRBY', last, format('%d', owed))
    owed = 0
  end
  last = nil
end

local function check(s, h)
  settle()
  local counter = h.key .. s.suffix
  h.counter = counter
  local after = tonumber(call('GET', counter) or '0') + h.cost
  if after <= s.limit then
    return true, s.limit - after, s.reset, s.start
  end
  return false, 0, s.reset, s.start
end

local function commit(s, h, _, tickets, o)
  settle()
  if call('INCRBY', h.counter, h.cost_text) == h.cost or every_charge_expires then
    call('PEXPIRE', h.counter, ttl(s, tickets, o))
  end
end

return {
  -- Every hit of a call decides at the same time, so all of a spec's hits share a window.
  -- Its suffix is formatted here ('%d' costs less than Lua's own number to text), once per
  -- window where the spec's table is kept from call to call (a function library). Times and
  -- windows are whole numbers, so rounding is done with '%', which costs less than a call of
  -- math.floor or math.ceil.
  prepare = function(s, now)
    local window, seconds = s.window, (now - now % 1000000) / 1000000
    local start = seconds - seconds % window
    if start ~= s.start then
      s.start = start
      s.suffix = separator .. format('%d', start)
      s.spread = window * 1000 < SPREAD_MS and window * 1000 or SPREAD_MS
    end
    local reset = (start + window) * 1000000 - now
    s.reset = reset
    s.ttl = (reset + 999 - (reset + 999) % 1000) / 1000
  end,

  check = check,

  -- Check and charge in one command: INCRBY counts and reads at once. A cost above the limit,
  -- refused unless the counter is below zero, is left to check and commit (take declines it),
  -- so no INCRBY can overflow. Then the counter INCRBY creates (it counts just this cost) is
  -- admitted, and gets its expiry; a refused one existed before, with its expiry, and gets
  -- its units back.
  take = function(s, key, cost, cost_text, tickets, o)
    if cost > s.limit then
      return
    end
    local counter = key .. s.suffix
    if counter == last then
      local after = count + cost
      if after > s.limit then
        return false, 0, s.reset, s.start
      end
      count, owed = after, owed + cost
      return true, s.limit - after, s.reset, s.start
    end
    if owed > 0 then
      settle()
    end
    local after = call('INCRBY', counter, cost_text)
    if not every_charge_expires then
      last, count = counter, after
    end
    if after > s.limit then
      call('DECRBY', counter, cost_text)
      count = after - cost
      return false, 0, s.reset, s.start
    end
    if after == cost or every_charge_expires then
      call('PEXPIRE', counter, ttl(s, tickets, o))
    end
    return true, s.limit - after, s.reset, s.start
  end,

  commit = commit,

  -- Within the charging call: take the charge back.
  undo = function(s, h)
    settle()
    call('DECRBY', h.key .. s.suffix, h.cost_text)
  end,

  -- h.stamp is the window the charge went to, so a refund never lands in a later window.
  refund = function(s, h)
    settle()
    local counter = h.key .. separator .. h.stamp
    if call('EXISTS', counter) == 1 then
      call('DECRBY', counter, h.cost_text)
    end
  end,

  finish = settle,

  -- A call that ended in an error paid nothing it owed, and never will: the next one starts
  -- from the counters.
  begin = function()
    last, count, owed = nil, 0, 0
  end,
}
