//! Quota leases: for a rule with `lease: k`, an instance takes k units from Redis in one
//! round trip and spends them locally, so a hot key costs Redis one call per k requests.
//!
//! Nothing is admitted that Redis did not grant: a request is admitted locally only from
//! units Redis already charged, so the total never exceeds the limit. Unused units are not
//! given back; they lapse (at the end of a fixed window, or, for a token bucket, after the
//! time the bucket takes to earn them again, so leased tokens cannot pile up into a burst the
//! bucket would not allow). That lapse is what leases cost: up to k-1 units per instance per
//! window may go unspent. Leases apply to requests with a single enforced, charging hit;
//! anything else goes to the backend as it is.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::Backend;
use crate::decision::bounded::Capacity;
use crate::decision::limit::Limit;
use crate::decision::{BackendError, Charging, Hit, Outcome, Role};

/// Units granted by Redis, not yet spent by this instance.
struct Lease {
    units: u64,
    lapses: Instant,
    limit: Limit,
}

/// When a lease lapses, or `None` once it is spent: it may go then.
fn expiry(lease: &Lease) -> Option<Instant> {
    (lease.units > 0).then_some(lease.lapses)
}

#[derive(Default)]
struct Leases {
    by_key: HashMap<String, Lease>,
    capacity: Capacity,
}

pub struct Leased<B> {
    inner: B,
    leases: Mutex<Leases>,
    /// Bounds the leases kept (one per leased key in use).
    max_leases: usize,
}

impl<B: Backend> Leased<B> {
    pub fn new(inner: B, max_leases: usize) -> Leased<B> {
        Leased {
            inner,
            leases: Mutex::default(),
            max_leases,
        }
    }

    fn leases(&self) -> std::sync::MutexGuard<'_, Leases> {
        self.leases.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Spend `hit` from this instance's lease, if it holds enough.
    fn spend(&self, hit: &Hit, now: Instant) -> Option<Outcome> {
        let mut leases = self.leases();
        let lease = leases.by_key.get_mut(&hit.key)?;
        if lease.limit != hit.limit || now >= lease.lapses || lease.units < hit.units {
            return None;
        }
        lease.units -= hit.units;
        let outcome = Outcome {
            admitted: true,
            remaining: u32::try_from(lease.units).unwrap_or(u32::MAX),
            reset_after: lease.lapses - now,
        };
        if lease.units == 0 {
            leases.capacity.clear();
        }
        Some(outcome)
    }

    fn keep(&self, hit: &Hit, units: u64, granted: &Outcome, now: Instant) {
        let limit = hit.limit;
        let lapse = match limit.algorithm.batch_lapse(&limit, units) {
            Some(lapse) => Duration::from_micros(lapse).min(granted.reset_after),
            None => granted.reset_after,
        };
        let lease = Lease {
            units,
            lapses: now + lapse,
            limit,
        };
        let mut leases = self.leases();
        let Leases { by_key, capacity } = &mut *leases;
        capacity.insert(
            by_key,
            self.max_leases,
            (hit.key.clone(), lease),
            now,
            expiry,
        );
    }
}

/// A request whose single hit may be served from a lease.
fn leasable(hits: &[Hit]) -> Option<&Hit> {
    match hits {
        [hit]
            if hit.limit.quota_lease > 1
                && hit.role == Role::Enforce
                && hit.units > 0
                && hit.permit.is_none() =>
        {
            Some(hit)
        }
        _ => None,
    }
}

impl<B: Backend> Backend for Leased<B> {
    async fn evaluate(
        &self,
        hits: &[Hit],
        charging: Charging,
    ) -> Result<Vec<Outcome>, BackendError> {
        // A call that charges nothing must not take units for a lease.
        let Some(hit) = leasable(hits).filter(|_| charging != Charging::Nothing) else {
            return self.inner.evaluate(hits, charging).await;
        };
        let now = Instant::now();
        if let Some(outcome) = self.spend(hit, now) {
            return Ok(vec![outcome]);
        }
        // Take a lease: the request's own units and the rest of the lease at once.
        let take = u64::from(hit.limit.quota_lease).max(hit.units);
        let taking = Hit {
            units: take,
            ..hit.clone()
        };
        let granted = self.inner.evaluate(&[taking], charging).await?;
        if let Some(outcome) = granted.first().filter(|o| o.admitted) {
            self.keep(hit, take - hit.units, outcome, now);
            return Ok(granted);
        }
        // Less than a lease is left: ask for the request's own units only.
        self.inner.evaluate(hits, charging).await
    }

    async fn ready(&self) -> bool {
        self.inner.ready().await
    }

    fn switches(&self) -> u64 {
        self.inner.switches()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::memory::{DEFAULT_MAX_BYTES, MemoryBackend};
    use crate::decision::limit::Unit;

    #[tokio::test]
    async fn a_full_set_of_leases_makes_room_once_a_lease_is_spent_or_lapses() {
        // Two leases at most; leases of 10 from a limit of 100 per second.
        let leased = Leased::new(MemoryBackend::new(100, DEFAULT_MAX_BYTES), 2);
        let limit = Limit {
            quota_lease: 10,
            ..Limit::fixed(100, Unit::Second)
        };
        let remaining = |key: &'static str| {
            let hit = Hit {
                key: key.into(),
                limit,
                units: 1,
                role: Role::Enforce,
                permit: None,
            };
            let leased = &leased;
            async move {
                let outcomes = leased.evaluate(&[hit], Charging::Atomic).await.unwrap();
                assert!(outcomes[0].admitted, "{key}");
                outcomes[0].remaining
            }
        };
        // Start just after a window's start (windows are whole seconds), far from its end.
        let into = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        tokio::time::sleep(Duration::from_nanos(u64::from(1_050_000_000 - into))).await;
        // Each answer: from the backend (the limit's remaining after a lease of 10), or from
        // this instance's lease (the lease's units left).
        let rows: [(&str, u32); 16] = [
            ("a", 90),
            ("b", 90),
            // Both leases live: c's lease is taken but not kept, twice.
            ("c", 90),
            ("c", 80),
            ("a", 8),
            ("a", 7),
            ("a", 6),
            ("a", 5),
            ("a", 4),
            ("a", 3),
            ("a", 2),
            ("a", 1),
            // a's lease is spent: c's next lease takes its place.
            ("a", 0),
            ("c", 70),
            ("c", 8),
            ("b", 8),
        ];
        for (n, (key, expected)) in rows.into_iter().enumerate() {
            assert_eq!(remaining(key).await, expected, "row {n}: {key}");
        }
        // Full again (b and c live, d turned away); once they lapse, d's lease is kept.
        assert_eq!(remaining("d").await, 90);
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        assert_eq!(remaining("d").await, 90, "a new window");
        assert_eq!(remaining("d").await, 8, "from d's lease");
    }
}
