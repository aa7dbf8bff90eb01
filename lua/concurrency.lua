-- Concurrency: a sorted set <key> of leases, member = the request's id, score = when the
-- lease expires (us, Redis time). h.lease is '+<id>' to take a lease, '-<id>' to give it
-- back, '' to read. Expired leases are dropped first, so a lost release cannot leak
-- capacity for longer than one window. Mirrors src/algorithm/concurrency.rs.
local function lease_of(h)
  local op, id = string.sub(h.lease, 1, 1), string.sub(h.lease, 2)
  return op, id
end

-- Put a request's lease back as it was before a charge: `expiry` (0: it held none). A lease
-- given back since (a release later in the same request, or a stream-done call) stays given
-- back: its request is over.
local function restore(h, id, expiry)
  if not redis.call('ZSCORE', h.key, id) then
    return
  end
  if expiry > 0 then
    redis.call('ZADD', h.key, expiry, id)
  else
    redis.call('ZREM', h.key, id)
  end
end

local twin = {
  check = function(h, now)
    redis.call('ZREMRANGEBYSCORE', h.key, '-inf', now)
    local live = redis.call('ZCARD', h.key)
    local window = h.window * 1000000
    local op, id = lease_of(h)
    local held = id ~= '' and redis.call('ZSCORE', h.key, id)
    local holds = held ~= false and held ~= nil
    -- The stamp is the expiry of the lease the request held before (0: none), for a refund.
    local function ok(in_flight)
      return {
        admitted = true,
        remaining = math.max(h.limit - in_flight, 0),
        reset = window,
        stamp = holds and tonumber(held) or 0,
      }
    end
    if op == '-' then
      return ok(holds and live - 1 or live)
    elseif op == '+' and holds then
      return ok(live)
    elseif op == '+' and h.hits > 0 then
      if live < h.limit then
        return ok(live + 1)
      end
      local first = redis.call('ZRANGE', h.key, 0, 0, 'WITHSCORES')
      return { admitted = false, remaining = 0, reset = first[2] and (tonumber(first[2]) - now) or window }
    end
    return ok(live)
  end,

  commit = function(h, now, v)
    local op, id = lease_of(h)
    if op == '+' then
      redis.call('ZADD', h.key, now + h.window * 1000000, id)
      redis.call('PEXPIRE', h.key, h.window * 1000 + 1)
    elseif op == '-' then
      redis.call('ZREM', h.key, id)
    end
  end,

  undo = function(h, now, v)
    local op, id = lease_of(h)
    if op == '+' then
      restore(h, id, v.stamp)
    end
  end,

  refund = function(h, now)
    local op, id = lease_of(h)
    if op == '+' then
      restore(h, id, tonumber(h.stamp))
    end
  end,
}
return twin
