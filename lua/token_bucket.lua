-- Token bucket as GCRA: <key> holds the theoretical arrival time (TAT, us since the epoch,
-- fractional). A hit of cost n is admitted when max(TAT, now) + n*T - burst*T <= now, with
-- T = window / limit. Refused hits write nothing; the key expires when the bucket is full
-- again. Mirrors src/algorithm/token_bucket.rs.
local EPSILON = 1e-6

ALGORITHMS.token_bucket = {
  check = function(h, now)
    local window = h.window * 1000000
    if h.limit == 0 or h.hits > h.burst then
      return { admitted = false, remaining = 0, reset = window }
    end
    local t = window / h.limit
    local tat = math.max(tonumber(redis.call('GET', h.key) or '0'), now)
    local new_tat = tat + h.hits * t
    local allow_at = new_tat - h.burst * t
    if now + EPSILON < allow_at then
      return { admitted = false, remaining = 0, reset = math.ceil(allow_at - now) }
    end
    return {
      admitted = true,
      remaining = math.max(math.floor((now - allow_at) / t + EPSILON), 0),
      reset = math.ceil(new_tat - now),
      new_tat = new_tat,
    }
  end,

  commit = function(h, now, v)
    redis.call('SET', h.key, string.format('%.3f', v.new_tat), 'PX', math.max(math.ceil(v.reset / 1000), 1))
  end,

  refund = function(h, now)
    local tat = tonumber(redis.call('GET', h.key) or '0')
    local back = tat - h.hits * (h.window * 1000000 / h.limit)
    if back <= now then
      redis.call('DEL', h.key)
    else
      redis.call('SET', h.key, string.format('%.3f', back), 'PX', math.ceil((back - now) / 1000))
    end
  end,
}
