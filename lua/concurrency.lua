-- Concurrency: a sorted set <key> of permits, member = the request's id, score = when the
-- permit expires (us, Redis time). h.permit is '+<id>' to take a permit, '-<id>' to give it
-- back, '' to read. Expired permits are dropped first, so a lost release cannot leak
-- capacity for longer than one window. Mirrors src/algorithm/concurrency.rs.
local call, tonumber = redis.call, tonumber

local function permit_of(h)
  local op, id = string.sub(h.permit, 1, 1), string.sub(h.permit, 2)
  return op, id
end

-- Put a request's permit back as it was before a charge: `expiry` (0: it held none). A permit
-- given back since (a release later in the same request, or a stream-done call) stays given
-- back: its request is over.
local function restore(h, id, expiry)
  if not call('ZSCORE', h.key, id) then
    return
  end
  if expiry > 0 then
    call('ZADD', h.key, expiry, id)
  else
    call('ZREM', h.key, id)
  end
end

-- An admission with `in_flight` permits held after it; `before` is the stamp.
local function admit(s, in_flight, before)
  return true, math.max(s.limit - in_flight, 0), s.span, before
end

return {
  prepare = function(s)
    s.span = s.window * 1000000
  end,

  check = function(s, h, now)
    call('ZREMRANGEBYSCORE', h.key, '-inf', now)
    local live = call('ZCARD', h.key)
    local op, id = permit_of(h)
    local held = id ~= '' and call('ZSCORE', h.key, id)
    local holds = held ~= false and held ~= nil
    -- The stamp is the expiry of the permit the request held before (0: none), for a refund.
    local before = holds and tonumber(held) or 0
    h.before = before
    if op == '-' then
      return admit(s, holds and live - 1 or live, before)
    elseif op == '+' and holds then
      return admit(s, live, before)
    elseif op == '+' and h.cost > 0 then
      if live < s.limit then
        return admit(s, live + 1, before)
      end
      local first = call('ZRANGE', h.key, 0, 0, 'WITHSCORES')
      return false, 0, first[2] and (tonumber(first[2]) - now) or s.span, 0
    end
    return admit(s, live, before)
  end,

  commit = function(s, h, now)
    local op, id = permit_of(h)
    if op == '+' then
      call('ZADD', h.key, now + s.span, id)
      call('PEXPIRE', h.key, s.window * 1000 + 1)
    elseif op == '-' then
      call('ZREM', h.key, id)
    end
  end,

  undo = function(s, h)
    local op, id = permit_of(h)
    if op == '+' then
      restore(h, id, h.before)
    end
  end,

  refund = function(s, h)
    local op, id = permit_of(h)
    if op == '+' then
      restore(h, id, tonumber(h.stamp))
    end
  end,
}
