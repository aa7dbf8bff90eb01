-- Sliding window log: a sorted set <key> of admissions scored by their Redis time (us), each
-- member "<nonce>:<index>:<cost>", plus <key>:n holding the sum of the live costs so a check
-- never scans the log. An entry leaves exactly one window after its admission. Mirrors
-- src/algorithm/sliding_window.rs.
local call, tonumber, format = redis.call, tonumber, string.format

local function cost_of(member)
  return tonumber(string.match(member, '(%d+)$'))
end

-- Hit indices as text, each formatted once per call.
local indices = {}

-- The hit's entry in the log: named after the call's nonce and the hit's index, so the
-- charging call (undo) and a later refund call remove exactly it.
local function member_of(h)
  local index = indices[h.index]
  if not index then
    index = format('%d', h.index)
    indices[h.index] = index
  end
  return h.nonce .. ':' .. index .. ':' .. h.cost_text
end

local function refund(s, h)
  if call('ZREM', h.key, member_of(h)) == 1 then
    call('DECRBY', h.key .. ':n', h.cost_text)
  end
end

return {
  -- Its entries are named after the request (h.nonce): the driver passes the nonce only to
  -- twins that say so.
  named = true,

  -- What every hit of the spec shares in this call, as the text Redis is given.
  prepare = function(s, now)
    s.span = s.window * 1000000
    s.now = format('%d', now)
    s.horizon = format('%d', now - s.span)
    -- PEXPIRE counts from the server's millisecond, which may precede 'now' by up to 1 ms;
    -- the extra millisecond keeps the log until its newest entry has really left the window.
    s.ttl = format('%d', s.window * 1000 + 1)
  end,

  check = function(s, h, now)
    local log, sum = h.key, h.key .. ':n'
    local window = s.span
    -- Dropping entries that already left the window changes no decision, so the check may
    -- do it; it keeps the sum honest.
    local expired = call('ZRANGEBYSCORE', log, '-inf', s.horizon)
    if #expired > 0 then
      local freed = 0
      for _, member in ipairs(expired) do
        freed = freed + cost_of(member)
      end
      call('ZREMRANGEBYSCORE', log, '-inf', s.horizon)
      call('DECRBY', sum, freed)
    end
    local after = tonumber(call('GET', sum) or '0') + h.cost
    h.sum, h.after = sum, after
    if after <= s.limit then
      local reset = window
      if h.cost == 0 then
        local newest = call('ZRANGE', log, -1, -1, 'WITHSCORES')
        reset = newest[2] and (tonumber(newest[2]) + window - now) or 0
      end
      return true, s.limit - after, reset, 0
    end
    -- Refused: wait until enough of the oldest entries have aged out.
    local reset = window
    if h.cost <= s.limit then
      local must_free, freed, from, found = after - s.limit, 0, 0, false
      while not found do
        local page = call('ZRANGE', log, from, from + 99, 'WITHSCORES')
        if #page == 0 then break end
        for i = 1, #page, 2 do
          freed = freed + cost_of(page[i])
          if freed >= must_free then
            reset = tonumber(page[i + 1]) + window - now
            found = true
            break
          end
        end
        from = from + 100
      end
    end
    return false, 0, reset, 0
  end,

  -- The sum the check read plus this cost, set with its expiry in one command (the same value
  -- INCRBY would leave).
  commit = function(s, h)
    call('ZADD', h.key, s.now, member_of(h))
    call('PEXPIRE', h.key, s.ttl)
    call('SET', h.sum, h.after, 'PX', s.ttl)
  end,

  undo = refund,
  refund = refund,
}
