-- Fixed window: one counter per epoch-aligned window, named <key><separator><window start
-- seconds>. The window is computed here from Redis TIME, never from the caller's clock. The
-- counter expires when its window ends. Mirrors src/algorithm/fixed_window.rs.
--
-- The chunk is given its key layout: 'turnstile' (<key>:<window start>) or 'reference', the
-- reference server's (<prefix><domain>_<key>_<value>_..._<window start>), so both servers
-- count on the same keys during a migration.
local layout = ...
local separator = layout == 'reference' and '' or ':'
return {
  check = function(h, now)
    local start = math.floor(math.floor(now / 1000000) / h.window) * h.window
    local counter = h.key .. separator .. start
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

  -- Within the charging call: take the charge back.
  undo = function(h, now, v)
    redis.call('DECRBY', v.counter, h.hits)
  end,

  -- h.stamp is the window the charge went to, so a refund never lands in a later window.
  refund = function(h, now)
    local counter = h.key .. separator .. h.stamp
    if redis.call('EXISTS', counter) == 1 then
      redis.call('DECRBY', counter, h.hits)
    end
  end,
}
