//! The over-limit cache: when the backend refuses a hit until time T, later hits on the same
//! key are refused locally until T, without a round trip, so a hot key over its limit (the
//! usual shape of abuse) costs Redis nothing.
//!
//! It only refuses, for the same limit and a cost at least as large, so it lets through
//! nothing Redis would refuse; and a cached refusal is answered even while the backend fails,
//! since a certain refusal must not turn into an error. What must reach the backend whatever
//! the verdict still goes: permits given back, and per-descriptor charges.
//!
//! Not a cache crate (moka, quick_cache): an entry matches only the same limit and a cost at
//! least as large, and a full cache turns new refusals away instead of evicting live ones
//! (`decision::bounded`), on the call path of every hot key.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::Backend;
use crate::decision::bounded::Capacity;
use crate::decision::limit::Limit;
use crate::decision::{BackendError, Charging, Hit, Outcome, Role};
use crate::ops::metrics::Metrics;

const STRIPES: usize = 16;

#[derive(Clone, Copy)]
struct Refusal {
    until: Instant,
    limit: Limit,
    units: u64,
}

/// One stripe of the cache: its refusals by key, behind their own lock.
#[derive(Default)]
struct Refusals {
    by_key: HashMap<String, Refusal>,
    capacity: Capacity,
}

pub struct OverLimitCache<B> {
    inner: B,
    stripes: Vec<Mutex<Refusals>>,
    hasher: RandomState,
    max_per_stripe: usize,
    metrics: Arc<Metrics>,
}

/// Refusals that hold until their reset: enforced, charging hits; not concurrency limits,
/// whose permits can come back at any moment.
fn cacheable(hit: &Hit) -> bool {
    hit.role == Role::Enforce && hit.units > 0 && !hit.limit.algorithm.in_flight()
}

/// A hit of a refused request that the backend was not asked about: it charged nothing, and
/// nothing is known to be spent.
fn untouched(hit: &Hit) -> Outcome {
    Outcome {
        admitted: true,
        remaining: hit.limit.requests_per_unit,
        reset_after: Duration::ZERO,
    }
}

impl<B: Backend> OverLimitCache<B> {
    /// `max_entries` bounds the memory; 0 disables the cache.
    pub fn new(inner: B, max_entries: usize, metrics: Arc<Metrics>) -> OverLimitCache<B> {
        OverLimitCache {
            inner,
            stripes: (0..STRIPES).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            max_per_stripe: max_entries.div_ceil(STRIPES),
            metrics,
        }
    }

    fn stripe(&self, key: &str) -> std::sync::MutexGuard<'_, Refusals> {
        self.stripes[self.hasher.hash_one(key) as usize % STRIPES]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The cached refusal that applies to `hit` now, if any.
    fn cached(&self, hit: &Hit, now: Instant) -> Option<Outcome> {
        if self.max_per_stripe == 0 || !cacheable(hit) {
            return None;
        }
        let refusal = *self.stripe(&hit.key).by_key.get(&hit.key)?;
        (now < refusal.until && refusal.limit == hit.limit && hit.units >= refusal.units).then(
            || Outcome {
                admitted: false,
                remaining: 0,
                reset_after: refusal.until - now,
            },
        )
    }

    fn remember(&self, hit: &Hit, outcome: &Outcome, now: Instant) {
        if self.max_per_stripe == 0
            || outcome.admitted
            || !cacheable(hit)
            || outcome.reset_after.is_zero()
        {
            return;
        }
        let refusal = Refusal {
            until: now + outcome.reset_after,
            limit: hit.limit,
            units: hit.units,
        };
        let mut stripe = self.stripe(&hit.key);
        let Refusals { by_key, capacity } = &mut *stripe;
        let entry = (hit.key.clone(), refusal);
        capacity.insert(by_key, self.max_per_stripe, entry, now, |r| Some(r.until));
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
        let must_reach = |hit: &Hit| charging == Charging::PerDescriptor || hit.releases();
        let rest: Vec<Hit> = hits
            .iter()
            .zip(&cached)
            .filter(|(h, c)| c.is_none() && must_reach(h))
            .map(|(h, _)| h.clone())
            .collect();
        let mut answered = Vec::new();
        if !rest.is_empty() {
            match self.inner.evaluate(&rest, charging).await {
                Ok(outcomes) if outcomes.len() == rest.len() => answered = outcomes,
                Ok(outcomes) => tracing::warn!(
                    answered = outcomes.len(),
                    hits = rest.len(),
                    "the backend answered a wrong number of outcomes"
                ),
                Err(error) => {
                    tracing::debug!(%error, "backend failed; a cached refusal answers anyway");
                }
            }
        }
        self.remember_all(&rest, &answered, now);
        let mut answered = answered.into_iter();
        Ok(hits
            .iter()
            .zip(cached)
            .map(|(hit, cached)| match cached {
                Some(refusal) => refusal,
                None if must_reach(hit) => answered.next().unwrap_or_else(|| untouched(hit)),
                None => untouched(hit),
            })
            .collect())
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
    use crate::decision::PermitOp;
    use crate::decision::limit::Unit;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Refuses "hot" for an hour and admits the rest, or fails when `down`; records what it
    /// was asked.
    #[derive(Default)]
    struct Fake {
        down: AtomicBool,
        asked: Mutex<Vec<String>>,
    }

    impl Backend for Arc<Fake> {
        async fn evaluate(&self, hits: &[Hit], _: Charging) -> Result<Vec<Outcome>, BackendError> {
            let mut asked = self.asked.lock().unwrap();
            asked.extend(hits.iter().map(|h| h.key.clone()));
            if self.down.load(Ordering::SeqCst) {
                return Err(BackendError::Unavailable("down".into()));
            }
            Ok(hits
                .iter()
                .map(|h| Outcome {
                    admitted: h.key != "hot",
                    remaining: if h.key == "hot" { 0 } else { 5 },
                    reset_after: Duration::from_secs(3_600),
                })
                .collect())
        }

        async fn ready(&self) -> bool {
            true
        }
    }

    fn hit(key: &str, permit: Option<PermitOp>) -> Hit {
        Hit {
            key: key.into(),
            limit: Limit::fixed(10, Unit::Hour),
            units: 1,
            role: Role::Enforce,
            permit: permit.map(|op| (op, "permit-1".into())),
        }
    }

    /// A request with a cached refusal is refused whatever the backend does; only what must
    /// reach the backend whatever the verdict is sent, and its failure changes nothing.
    #[tokio::test]
    async fn a_cached_refusal_refuses_at_once_and_sends_only_what_must_be_applied() {
        let untouched = 10;
        let from_backend = 5;
        // charging, the other hit's permit, backend down, other asked, its remaining
        let rows = [
            (Charging::Atomic, None, false, false, untouched),
            (Charging::Atomic, None, true, false, untouched),
            (
                Charging::Atomic,
                Some(PermitOp::Release),
                false,
                true,
                from_backend,
            ),
            (
                Charging::Atomic,
                Some(PermitOp::Release),
                true,
                true,
                untouched,
            ),
            (Charging::PerDescriptor, None, false, true, from_backend),
            (Charging::PerDescriptor, None, true, true, untouched),
        ];
        for (charging, permit, down, asked, remaining) in rows {
            let fake = Arc::new(Fake::default());
            let cache = OverLimitCache::new(fake.clone(), 100, Arc::new(Metrics::new(0.8, 10)));
            let hot = hit("hot", None);
            let first = cache.evaluate(std::slice::from_ref(&hot), charging).await;
            assert!(!first.unwrap()[0].admitted);
            fake.asked.lock().unwrap().clear();
            fake.down.store(down, Ordering::SeqCst);

            let row = format!("{charging:?} permit {permit:?} down {down}");
            let outcomes = cache
                .evaluate(&[hit("other", permit), hot], charging)
                .await
                .unwrap_or_else(|e| panic!("{row}: {e}"));
            assert!(!outcomes[1].admitted, "{row}: refused by the cache");
            assert!(outcomes[0].admitted, "{row}");
            assert_eq!(outcomes[0].remaining, remaining, "{row}");
            let sent = fake.asked.lock().unwrap().clone();
            let expected: Vec<String> = if asked { vec!["other".into()] } else { vec![] };
            assert_eq!(sent, expected, "{row}: what reached the backend");
        }
    }
}
