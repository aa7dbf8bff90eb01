//! How late a runtime wakes its tasks: the measure of this process's own delay, which a
//! timeout must not blame on the backend. The breaker asks it of the runtime serving calls;
//! the Redis backend of the runtime that reads a call's reply.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How late this process's runtime wakes a task that asked to be woken: near zero on a
/// healthy process, the length of the run queue on a saturated one.
pub(crate) struct Lag {
    shared: Arc<LagShared>,
}

struct LagShared {
    base: Instant,
    /// When the ticker last woke, in microseconds since `base`.
    woke: AtomicU64,
    /// How late it woke then, in microseconds.
    late: AtomicU64,
}

/// The ticker's period: a few thousand cheap wake-ups a minute.
const TICK: Duration = Duration::from_millis(5);
/// Lag below this is the timers' own granularity (1 ms) and ordinary scheduling.
const LAG_FLOOR: Duration = Duration::from_millis(2);

impl Lag {
    /// Start the ticker; it stops when the `Lag` is dropped.
    pub(crate) fn start() -> Lag {
        let shared = Arc::new(LagShared {
            base: Instant::now(),
            woke: AtomicU64::new(0),
            late: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&shared);
        tokio::spawn(async move {
            loop {
                let due = Instant::now() + TICK;
                tokio::time::sleep_until(due.into()).await;
                let Some(shared) = weak.upgrade() else {
                    return;
                };
                let now = Instant::now();
                shared.late.store(micros(now - due), Ordering::Relaxed);
                shared
                    .woke
                    .store(micros(now - shared.base), Ordering::Relaxed);
            }
        });
        Lag { shared }
    }

    /// Whether the lag now accounts for a wait of `waited`: it is over half of it (and over
    /// the timers' own granularity).
    pub(crate) fn explains(&self, waited: Duration) -> bool {
        self.recent() > (waited / 2).max(LAG_FLOOR)
    }

    /// The lag now: how late the ticker last woke, or how overdue it is if that is more.
    fn recent(&self) -> Duration {
        let shared = &self.shared;
        let woke = Duration::from_micros(shared.woke.load(Ordering::Relaxed));
        let overdue = shared.base.elapsed().saturating_sub(woke + TICK);
        Duration::from_micros(shared.late.load(Ordering::Relaxed)).max(overdue)
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
