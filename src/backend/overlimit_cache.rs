//! The over-limit cache: when the backend refuses a hit until time T, later hits on the same
//! key are refused locally until T, without a round trip. A hot key that is over its limit
//! (the usual shape of abuse) then costs Redis nothing.
//!
//! It can only refuse, never admit, so it cannot let through anything Redis would refuse. A
//! cached refusal holds only for the same limit (a reload or a request override that changes
//! the limit bypasses it: a raised override is honoured at once) and for hits costing at least
//! as much as the refused one; reads (cost 0) always go to the backend. When a request has
//! other hits, they are still asked of the backend, charging nothing if the cached refusal
//! already refuses the request, so every status carries the figures it would without the
//! cache.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use super::{Backend, BackendError, Charging, Hit, Outcome, Role};
use crate::limit::{Algorithm, Limit};
use crate::metrics::Metrics;

const SHARDS: usize = 16;

#[derive(Clone, Copy)]
struct Refusal {
    until: Instant,
    limit: Limit,
    hits: u64,
}

pub struct OverLimitCache<B> {
    inner: B,
    shards: Vec<Mutex<HashMap<String, Refusal>>>,
    hasher: RandomState,
    max_per_shard: usize,
    metrics: Arc<Metrics>,
}

/// Refusals that hold until their reset: enforced, charging hits; not concurrency limits,
/// whose leases can come back at any moment.
fn cacheable(hit: &Hit) -> bool {
    hit.role == Role::Enforce && hit.hits > 0 && hit.limit.algorithm != Algorithm::Concurrency
}

impl<B: Backend> OverLimitCache<B> {
    /// `max_entries` bounds the memory; 0 disables the cache.
    pub fn new(inner: B, max_entries: usize, metrics: Arc<Metrics>) -> OverLimitCache<B> {
        OverLimitCache {
            inner,
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            max_per_shard: max_entries.div_ceil(SHARDS),
            metrics,
        }
    }

    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, HashMap<String, Refusal>> {
        self.shards[self.hasher.hash_one(key) as usize % SHARDS]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The cached refusal that applies to `hit` now, if any.
    fn cached(&self, hit: &Hit, now: Instant) -> Option<Outcome> {
        if self.max_per_shard == 0 || !cacheable(hit) {
            return None;
        }
        let refusal = *self.shard(&hit.key).get(&hit.key)?;
        (now < refusal.until && refusal.limit == hit.limit && hit.hits >= refusal.hits).then(|| {
            Outcome {
                admitted: false,
                remaining: 0,
                reset_after: refusal.until - now,
            }
        })
    }

    fn remember(&self, hit: &Hit, outcome: &Outcome, now: Instant) {
        if self.max_per_shard == 0
            || outcome.admitted
            || !cacheable(hit)
            || outcome.reset_after.is_zero()
        {
            return;
        }
        let mut shard = self.shard(&hit.key);
        if shard.len() >= self.max_per_shard && !shard.contains_key(&hit.key) {
            shard.retain(|_, r| r.until > now);
            if shard.len() >= self.max_per_shard {
                return;
            }
        }
        shard.insert(
            hit.key.clone(),
            Refusal {
                until: now + outcome.reset_after,
                limit: hit.limit,
                hits: hit.hits,
            },
        );
    }
}

impl<B: Backend> OverLimitCache<B> {
    /// Remember the refusals of one request's answer. A hit whose key came earlier in the
    /// request was judged after that earlier hit's charge, which a refused request does not
    /// make: its refusal says nothing about the key alone.
    fn remember_all(&self, hits: &[Hit], outcomes: &[Outcome], now: Instant) {
        for (i, (hit, outcome)) in hits.iter().zip(outcomes).enumerate() {
            if hits[..i].iter().all(|earlier| earlier.key != hit.key) {
                self.remember(hit, outcome, now);
            }
        }
    }
}

impl<B: Backend> Backend for OverLimitCache<B> {
    async fn evaluate(
        &self,
        hits: &[Hit],
        charging: Charging,
    ) -> Result<Vec<Outcome>, BackendError> {
        let now = Instant::now();
        let cached: Vec<Option<Outcome>> = hits.iter().map(|h| self.cached(h, now)).collect();
        if cached.iter().all(Option::is_none) {
            let outcomes = self.inner.evaluate(hits, charging).await?;
            self.remember_all(hits, &outcomes, now);
            return Ok(outcomes);
        }
        self.metrics
            .local_cache_hits
            .increment(cached.iter().flatten().count() as u64);
        // A cached refusal (always of an enforced hit) refuses the request, so under atomic
        // charging the rest is charged nothing; under per-descriptor charging it is charged.
        // Either way each is judged at its own cost, so its figures are those the backend
        // gives without the cache (remaining after this hit, as if charged).
        let rest_charging = match charging {
            Charging::Atomic => Charging::Nothing,
            other => other,
        };
        let rest: Vec<Hit> = hits
            .iter()
            .zip(&cached)
            .filter(|(_, c)| c.is_none())
            .map(|(h, _)| h.clone())
            .collect();
        let answered = if rest.is_empty() {
            Vec::new()
        } else {
            self.inner.evaluate(&rest, rest_charging).await?
        };
        if answered.len() != rest.len() {
            return Err(BackendError::Unavailable(format!(
                "backend answered {} outcomes for {} hits",
                answered.len(),
                rest.len()
            )));
        }
        self.remember_all(&rest, &answered, now);
        let mut answered = answered.into_iter();
        Ok(cached
            .into_iter()
            .filter_map(|c| c.or_else(|| answered.next()))
            .collect())
    }

    async fn ready(&self) -> bool {
        self.inner.ready().await
    }
}
