-- Sliding window log: a sorted set <key> of admissions scored by their Redis time (us), each
-- member "<nonce>:<index>:<cost>", plus <key>:n holding the sum of the live costs so a check
-- never scans the log. An entry leaves exactly one window after its admission. Mirrors
-- src/algorithm/sliding_window.rs.
local function cost_of(member)
  return tonumber(string.match(member, '(%d+)$'))
end

local twin = {
  check = function(h, now)
    local log, sum = h.key, h.key .. ':n'
    local window = h.window * 1000000
    local horizon = now - window
    -- Dropping entries that already left the window changes no decision, so the check may
    -- do it; it keeps the sum honest.
    local expired = redis.call('ZRANGEBYSCORE', log, '-inf', horizon)
    if #expired > 0 then
      local freed = 0
      for _, member in ipairs(expired) do
        freed = freed + cost_of(member)
      end
      redis.call('ZREMRANGEBYSCORE', log, '-inf', horizon)
      redis.call('DECRBY', sum, freed)
    end
    local after = tonumber(redis.call('GET', sum) or '0') + h.hits
    if after <= h.limit then
      local reset = window
      if h.hits == 0 then
        local newest = redis.call('ZRANGE', log, -1, -1, 'WITHSCORES')
        reset = newest[2] and (tonumber(newest[2]) + window - now) or 0
      end
      return { admitted = true, remaining = h.limit - after, reset = reset }
    end
    -- Refused: wait until enough of the oldest entries have aged out.
    local reset = window
    if h.hits <= h.limit then
      local must_free, freed, from, found = after - h.limit, 0, 0, false
      while not found do
        local page = redis.call('ZRANGE', log, from, from + 99, 'WITHSCORES')
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
    return { admitted = false, remaining = 0, reset = reset }
  end,

  commit = function(h, now, v)
    -- PEXPIRE counts from the server's millisecond, which may precede 'now' by up to 1 ms; the
    -- extra millisecond keeps the log until its newest entry has really left the window.
    local ttl = h.window * 1000 + 1
    redis.call('ZADD', h.key, now, h.member .. ':' .. h.hits)
    redis.call('PEXPIRE', h.key, ttl)
    redis.call('INCRBY', h.key .. ':n', h.hits)
    redis.call('PEXPIRE', h.key .. ':n', ttl)
  end,

  -- The entry is named after the call's nonce and the hit's index, so the charging call
  -- (undo) and a later refund call remove exactly it.
  refund = function(h, now)
    if redis.call('ZREM', h.key, h.member .. ':' .. h.hits) == 1 then
      redis.call('DECRBY', h.key .. ':n', h.hits)
    end
  end,
}
twin.undo = twin.refund
return twin
