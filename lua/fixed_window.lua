-- Fixed window: one counter per epoch-aligned window, named <key>:<window start seconds>.
-- The window is computed here from Redis TIME, never from the caller's clock. The counter
-- expires when its window ends. Mirrors src/algorithm/fixed_window.rs.
ALGORITHMS.fixed_window = {
  check = function(h, now)
    local start = math.floor(math.floor(now / 1000000) / h.window) * h.window
    local counter = h.key .. ':' .. start
    local after = tonumber(redis.call('GET', counter) or '0') + h.hits
    local window_end = (start + h.window) * 1000000
    local admitted = after <= h.limit
    return {
      admitted = admitted,
      remaining = admitted and (h.limit - after) or 0,
      reset = window_end - now,
      counter = counter,
      stamp = start,
    }
  end,

  commit = function(h, now, v)
    redis.call('INCRBY', v.counter, h.hits)
    redis.call('PEXPIRE', v.counter, math.ceil(v.reset / 1000))
  end,

  -- h.stamp is the window the charge went to, so a refund never lands in a later window.
  refund = function(h, now)
    local counter = h.key .. ':' .. h.stamp
    if redis.call('EXISTS', counter) == 1 then
      redis.call('DECRBY', counter, h.hits)
    end
  end,
}
