//! What turnstile answers when its backend fails: an explicit, configured choice, globally
//! and per domain (`on_backend_error` in the rules), never a hang.
//!
//! `error` answers UNAVAILABLE (the reference's behaviour: Envoy's `failure_mode_deny`
//! decides); `allow` admits (fail-open); `deny` refuses (fail-closed); `local` keeps limiting
//! in this process at `local_share` of each limit, so that N instances with a share of 1/N
//! stay close to the global limit while Redis is away. What `local` admits is owed to the
//! backend (`ledger`) and charged there before this instance decides from it again; each key
//! starts from its share of what the backend last said was left of it (`learned`), so a
//! window that spans an outage admits no more than its limit across the fleet.

use std::time::Duration;

use metrics::Counter;

use crate::algorithm::Micros;
use crate::backend::Backend;
use crate::backend::memory::{MemoryBackend, now_micros};
use crate::decision::deadline::Deadline;
use crate::decision::{BackendError, Charging, FailurePolicy, Hit, Outcome, Role};
use crate::ops::metrics::LedgerCounters;
use crate::service::learned::Learned;
use crate::service::ledger::{Ledger, carried};

/// How long a fail-closed answer tells the client to wait: about when the circuit breaker
/// next probes the backend.
const DENY_RETRY: Duration = Duration::from_secs(1);
/// Below this left of a caller's time, no call to charge the backend is started.
const MIN_SETTLE_BUDGET: Duration = Duration::from_millis(1);

/// Owed charges sent to the backend per call: a call's cost to Redis grows with its hits.
const CHARGES_PER_CALL: usize = 64;

/// The degraded-mode state: in-process limits at a share of the configured ones, what the
/// backend last said of each key, and what was admitted here and is owed to the backend.
pub struct Fallback {
    local: MemoryBackend,
    local_share: f64,
    learned: Learned,
    ledger: Ledger,
    /// Held by the request charging the ledger to the backend: the others wait for it.
    settling: tokio::sync::Mutex<()>,
    counters: LedgerCounters,
}

/// Whether a request may be decided by the backend, after the charges owed to it.
pub enum Settled {
    /// Nothing is owed: ask the backend.
    Done,
    /// Owed charges are left (the backend failed, or the caller's time ran out): answer by
    /// the policy.
    Owing(BackendError),
}

impl Fallback {
    /// `max_keys` and `max_bytes` bound the local limits' state; `ledger_keys` the keys whose
    /// last answer is kept and the keys charges are owed on.
    pub fn new(
        local_share: f64,
        max_keys: usize,
        max_bytes: usize,
        ledger_keys: usize,
    ) -> Fallback {
        Fallback {
            local: MemoryBackend::new(max_keys, max_bytes),
            local_share,
            learned: Learned::new(ledger_keys),
            ledger: Ledger::new(ledger_keys),
            settling: tokio::sync::Mutex::new(()),
            counters: LedgerCounters::default(),
        }
    }

    /// Count the keys the local state evicts when full in `evictions`.
    pub fn counting_evictions(self, evictions: Counter) -> Fallback {
        let local = self.local.counting_evictions(evictions);
        Fallback { local, ..self }
    }

    /// Count what becomes of the owed charges in `counters`.
    pub fn counting_charges(self, counters: LedgerCounters) -> Fallback {
        Fallback { counters, ..self }
    }

    /// Keep what the backend answered, for a later fallback to start from.
    pub fn learn(&self, hits: &[Hit], outcomes: &[Outcome]) {
        self.learned.remember(hits, outcomes, now_micros());
    }

    /// Hold the backend's `outcomes` on `hits` to the local share as well, for the keys this
    /// instance limited alone in windows still running, for a moment after it charged them
    /// (`ledger::HOLD`). The other instances may not have charged the backend yet with what
    /// they admitted alone, and every instance's share adds up to what the backend last said
    /// was left: so meanwhile a request is admitted only if the backend and the local share
    /// both admit it (the backend may then have charged a request refused here: counted,
    /// never under-counted).
    pub fn within_share(&self, hits: &[Hit], outcomes: &mut [Outcome], charging: Charging) {
        let now = now_micros();
        let alone: Vec<usize> = (0..hits.len())
            .filter(|&i| self.ledger.alone(&hits[i].key, now))
            .collect();
        if alone.is_empty() {
            return;
        }
        let scaled: Vec<Hit> = alone.iter().map(|&i| self.scale(&hits[i])).collect();
        let Ok(local) = self.local.evaluate_now(&scaled, Charging::Nothing, now) else {
            return;
        };
        for (&i, verdict) in alone.iter().zip(&local) {
            let outcome = &mut outcomes[i];
            outcome.remaining = outcome.remaining.min(verdict.remaining);
            if !verdict.admitted {
                outcome.admitted = false;
                outcome.reset_after = outcome.reset_after.max(verdict.reset_after);
            }
        }
        if charging.charges(hits, outcomes) {
            let admitted: Vec<Hit> = alone
                .iter()
                .zip(scaled)
                .filter(|&(&i, _)| outcomes[i].admitted)
                .map(|(_, hit)| hit)
                .collect();
            let _ = self
                .local
                .evaluate_now(&admitted, Charging::PerDescriptor, now);
        }
    }

    /// Whether charges are owed to the backend.
    pub fn owes(&self) -> bool {
        self.ledger.owes()
    }

    /// Charge the backend with what was admitted here, a call at a time, while `deadline`
    /// leaves time for one. What a failed call carried stays owed (all of it: charged twice
    /// rather than not at all).
    pub async fn settle<B: Backend>(&self, backend: &B, deadline: Deadline) -> Settled {
        let Some(_settling) = deadline.bound(self.settling.lock()).await else {
            return Settled::Owing(BackendError::Late);
        };
        while self.ledger.owes() {
            if deadline.remaining() < MIN_SETTLE_BUDGET {
                return Settled::Owing(BackendError::Late);
            }
            let taken = self.ledger.take(CHARGES_PER_CALL, now_micros());
            self.counters.dropped.increment(taken.dropped);
            if taken.owed.is_empty() {
                continue;
            }
            let hits: Vec<Hit> = taken.owed.iter().map(|owed| owed.hit()).collect();
            let charged = deadline
                .bound(backend.evaluate(&hits, Charging::PerDescriptor))
                .await
                .unwrap_or(Err(BackendError::Timeout));
            match charged {
                Ok(_) => {
                    let units = taken.owed.iter().map(|owed| owed.units).sum();
                    self.counters.carried.increment(units);
                    self.ledger.charged(taken.owed.len());
                }
                Err(error) => {
                    self.ledger.restore(taken.owed, now_micros());
                    return Settled::Owing(error);
                }
            }
        }
        self.ledger.settled(now_micros());
        Settled::Done
    }

    pub fn spawn_sweeper(&self, period: Duration) {
        self.local.spawn_sweeper(period);
    }

    /// The outcomes under `policy`, or `None` when the policy is to answer with an error.
    pub fn outcomes(
        &self,
        policy: FailurePolicy,
        hits: &[Hit],
        charging: Charging,
    ) -> Option<Result<Vec<Outcome>, BackendError>> {
        let all = |admitted, reset_after| {
            hits.iter()
                .map(|_| Outcome {
                    admitted,
                    remaining: 0,
                    reset_after,
                })
                .collect()
        };
        match policy {
            FailurePolicy::Error => None,
            FailurePolicy::Allow => Some(Ok(all(true, Duration::ZERO))),
            FailurePolicy::Deny => Some(Ok(all(false, DENY_RETRY))),
            FailurePolicy::Local => {
                let now = now_micros();
                let decide = || {
                    let scaled: Vec<Hit> = hits.iter().map(|h| self.scale(h)).collect();
                    for (hit, scaled) in hits.iter().zip(&scaled) {
                        self.start_from_learned(hit, scaled, now);
                    }
                    self.local.evaluate_now(&scaled, charging, now)
                };
                let decided = self.ledger.admit(hits, charging, now, decide);
                Some(decided.unwrap_or_else(|| {
                    self.counters.refused.increment(1);
                    Ok(all(false, DENY_RETRY))
                }))
            }
        }
    }

    /// The first local decision on a key whose last answer from the backend still holds:
    /// the local limit starts spent but for its share of what the backend said was left.
    fn start_from_learned(&self, hit: &Hit, scaled: &Hit, now: Micros) {
        if !carried(hit) {
            return;
        }
        let Some(remaining) = self.learned.recall(hit, now) else {
            return;
        };
        // The answer is a round trip old: meanwhile each of the other instances (1/share of
        // them) may have been admitted once more.
        let instances = (1.0 / self.local_share).ceil() as u32;
        let left =
            (f64::from(remaining.saturating_sub(instances)) * self.local_share).floor() as u32;
        // The local state may hold an earlier fallback's admissions in this window: it is
        // charged up to the learned count, not past it.
        let read = read_hit(scaled);
        let Ok(read) = self.local.evaluate_now(&[read], Charging::Nothing, now) else {
            return;
        };
        let local_left = read.first().map_or(0, |outcome| outcome.remaining);
        if local_left > left {
            let spent = Hit {
                units: u64::from(local_left - left),
                ..read_hit(scaled)
            };
            // Within what the local limit has left: nothing to answer.
            let _ = self
                .local
                .evaluate_now(&[spent], Charging::PerDescriptor, now);
        }
    }

    /// A hit against `local_share` of its limit (at least 1 when the limit is not 0).
    fn scale(&self, hit: &Hit) -> Hit {
        let share = |n: u32| {
            if n == 0 {
                0
            } else {
                ((f64::from(n) * self.local_share).floor() as u32).max(1)
            }
        };
        let mut scaled = hit.clone();
        scaled.limit.requests_per_unit = share(hit.limit.requests_per_unit);
        scaled.limit.burst = share(hit.limit.burst);
        scaled
    }
}

/// `hit` enforced at no cost: what reads its state.
fn read_hit(hit: &Hit) -> Hit {
    Hit {
        units: 0,
        role: Role::Enforce,
        ..hit.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::Role;
    use crate::decision::limit::{Limit, Unit};

    fn hit(limit: u32) -> Hit {
        Hit {
            key: "k".into(),
            limit: Limit::fixed(limit, Unit::Hour),
            units: 1,
            role: Role::Enforce,
            permit: None,
        }
    }

    #[test]
    fn policies_answer_without_the_backend() {
        let f = Fallback::new(0.25, 100, crate::backend::memory::DEFAULT_MAX_BYTES, 100);
        let hits = [hit(8)];
        assert!(
            f.outcomes(FailurePolicy::Error, &hits, Charging::Atomic)
                .is_none()
        );
        let allow = f.outcomes(FailurePolicy::Allow, &hits, Charging::Atomic);
        assert!(allow.unwrap().unwrap()[0].admitted);
        let deny = f.outcomes(FailurePolicy::Deny, &hits, Charging::Atomic);
        assert!(!deny.unwrap().unwrap()[0].admitted);
    }

    #[test]
    fn local_mode_limits_at_the_configured_share() {
        let f = Fallback::new(0.25, 100, crate::backend::memory::DEFAULT_MAX_BYTES, 100);
        let admitted = (0..10)
            .filter(|_| {
                f.outcomes(FailurePolicy::Local, &[hit(8)], Charging::Atomic)
                    .unwrap()
                    .unwrap()[0]
                    .admitted
            })
            .count();
        assert_eq!(admitted, 2, "a quarter of 8");
        let tiny = f.outcomes(
            FailurePolicy::Local,
            &[Hit {
                key: "t".into(),
                ..hit(1)
            }],
            Charging::Atomic,
        );
        assert!(
            tiny.unwrap().unwrap()[0].admitted,
            "a share never rounds a limit to 0"
        );
    }

    #[test]
    fn policy_names_round_trip() {
        for p in FailurePolicy::ALL {
            assert_eq!(FailurePolicy::parse(p.name()), Some(p));
        }
        assert_eq!(FailurePolicy::parse("open"), None);
    }
}
