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
use crate::decision::{BackendError, Charging, Hit, Outcome, Role};
use crate::limit::Limit;

/// Units granted by Redis, not yet spent by this instance.
struct Pool {
    units: u64,
    lapses: Instant,
    limit: Limit,
}

pub struct Leased<B> {
    inner: B,
    pools: Mutex<HashMap<String, Pool>>,
    /// Bounds the pools kept (one per leased key in use).
    max_pools: usize,
}

impl<B: Backend> Leased<B> {
    pub fn new(inner: B, max_pools: usize) -> Leased<B> {
        Leased {
            inner,
            pools: Mutex::default(),
            max_pools,
        }
    }

    fn pools(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pool>> {
        self.pools.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Spend `hit` from this instance's pool, if it holds enough.
    fn spend(&self, hit: &Hit, now: Instant) -> Option<Outcome> {
        let mut pools = self.pools();
        let pool = pools.get_mut(&hit.key)?;
        if pool.limit != hit.limit || now >= pool.lapses || pool.units < hit.hits {
            return None;
        }
        pool.units -= hit.hits;
        Some(Outcome {
            admitted: true,
            remaining: u32::try_from(pool.units).unwrap_or(u32::MAX),
            reset_after: pool.lapses - now,
        })
    }

    fn keep(&self, hit: &Hit, units: u64, granted: &Outcome, now: Instant) {
        let limit = hit.limit;
        let lapse = match limit.algorithm.batch_lapse(&limit, units) {
            Some(lapse) => Duration::from_micros(lapse).min(granted.reset_after),
            None => granted.reset_after,
        };
        let mut pools = self.pools();
        if pools.len() >= self.max_pools && !pools.contains_key(&hit.key) {
            pools.retain(|_, p| p.lapses > now && p.units > 0);
            if pools.len() >= self.max_pools {
                return;
            }
        }
        pools.insert(
            hit.key.clone(),
            Pool {
                units,
                lapses: now + lapse,
                limit,
            },
        );
    }
}

/// A request whose single hit may be served from a lease.
fn leasable(hits: &[Hit]) -> Option<&Hit> {
    match hits {
        [hit]
            if hit.limit.quota_lease > 1
                && hit.role == Role::Enforce
                && hit.hits > 0
                && hit.lease.is_none() =>
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
        // A call that charges nothing must not take units for a pool.
        let Some(hit) = leasable(hits).filter(|_| charging != Charging::Nothing) else {
            return self.inner.evaluate(hits, charging).await;
        };
        let now = Instant::now();
        if let Some(outcome) = self.spend(hit, now) {
            return Ok(vec![outcome]);
        }
        // Take a lease: the request's own units and the rest of the lease at once.
        let lease = u64::from(hit.limit.quota_lease).max(hit.hits);
        let taking = Hit {
            hits: lease,
            ..hit.clone()
        };
        let granted = self.inner.evaluate(&[taking], charging).await?;
        if let Some(outcome) = granted.first().filter(|o| o.admitted) {
            self.keep(hit, lease - hit.hits, outcome, now);
            return Ok(granted);
        }
        // Less than a lease is left: ask for the request's own units only.
        self.inner.evaluate(hits, charging).await
    }

    async fn ready(&self) -> bool {
        self.inner.ready().await
    }
}
