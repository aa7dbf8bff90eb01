//! Redis' clock as seen from here, so that a call can carry its caller's deadline in the time
//! the script reads (TIME), and a decision nobody waits for any more charges nothing.
//!
//! Every reply ends with the script's time R; the call was sent at local time S, so
//! R - S = offset + the time the call took to reach Redis: each reply bounds the offset from
//! above, and the smallest bound seen is the tightest. A deadline converted with it is never
//! earlier on Redis' clock than the true one (later by at most the fastest reply's trip to
//! Redis: a script that late still charges), so a script cannot judge itself late while its
//! caller still waits, unless Redis' clock moved ahead (a jump, a failover to a server whose
//! clock is ahead, Cluster nodes that disagree). That shows as a late reply that arrives
//! before the deadline here: the estimate then restarts from that reply (and the caller sends
//! the call again). A bound is kept at most a minute, so drift is followed too.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long the smallest bound is trusted before a newer reply replaces it.
const TRUSTED: Duration = Duration::from_secs(60);

pub(super) struct Clock {
    base: Instant,
    /// Redis' time minus local time since `base`, in microseconds, and when that was learned.
    offset: Mutex<Option<(i64, Instant)>>,
}

impl Default for Clock {
    fn default() -> Clock {
        Clock {
            base: Instant::now(),
            offset: Mutex::new(None),
        }
    }
}

impl Clock {
    fn local(&self, at: Instant) -> i64 {
        i64::try_from(at.saturating_duration_since(self.base).as_micros()).unwrap_or(i64::MAX)
    }

    /// `at` on Redis' clock, in microseconds; None until a reply has been seen.
    pub(super) fn redis_time(&self, at: Instant) -> Option<i64> {
        let offset = self.offset.lock().unwrap_or_else(PoisonError::into_inner);
        offset.map(|(offset, _)| self.local(at).saturating_add(offset))
    }

    /// A script that ran at `redis_now` answered a call sent at `sent`.
    pub(super) fn observe(&self, sent: Instant, redis_now: i64) {
        self.learn(sent, redis_now, false);
    }

    /// A script judged itself late while its deadline had not passed here: Redis' clock is
    /// ahead of the estimate, which restarts from this reply.
    pub(super) fn restart(&self, sent: Instant, redis_now: i64) {
        self.learn(sent, redis_now, true);
    }

    fn learn(&self, sent: Instant, redis_now: i64, restart: bool) {
        let bound = redis_now.saturating_sub(self.local(sent));
        let now = Instant::now();
        let mut offset = self.offset.lock().unwrap_or_else(PoisonError::into_inner);
        let replace = match *offset {
            Some((best, since)) => restart || bound <= best || now - since > TRUSTED,
            None => true,
        };
        if replace {
            *offset = Some((bound, now));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tightest_upper_bound_wins_until_a_restart() {
        let clock = Clock::default();
        let t0 = clock.base + Duration::from_millis(10);
        assert_eq!(clock.redis_time(t0), None, "unknown before any reply");
        // Redis' clock is 1 000 000 µs ahead; replies took 300 and 40 µs to get there.
        clock.observe(t0, 1_010_000 + 300);
        clock.observe(t0, 1_010_000 + 40);
        clock.observe(t0, 1_010_000 + 900);
        assert_eq!(clock.redis_time(t0), Some(1_010_040));
        // The clock jumped 5 ms ahead: only a restart takes a larger bound.
        clock.restart(t0, 1_015_000 + 40);
        assert_eq!(clock.redis_time(t0), Some(1_015_040));
    }
}
