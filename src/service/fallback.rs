//! What turnstile answers when its backend fails: an explicit, configured choice, globally
//! and per domain (`on_backend_error` in the rules), never a hang.
//!
//! `error` answers UNAVAILABLE (the reference's behaviour: Envoy's `failure_mode_deny`
//! decides); `allow` admits (fail-open); `deny` refuses (fail-closed); `local` keeps limiting
//! in this process at `local_share` of each limit, so that N instances with a share of 1/N
//! stay close to the global limit while Redis is away.

use std::time::Duration;

use crate::backend::memory::MemoryBackend;
use crate::decision::{BackendError, Charging, FailurePolicy, Hit, Outcome};

/// How long a fail-closed answer tells the client to wait: about when the circuit breaker
/// next probes the backend.
const DENY_RETRY: Duration = Duration::from_secs(1);

/// The degraded-mode state: in-process limits at a share of the configured ones.
pub struct Fallback {
    local: MemoryBackend,
    local_share: f64,
}

impl Fallback {
    pub fn new(local_share: f64, max_keys: usize, max_bytes: usize) -> Fallback {
        let local = MemoryBackend::new(max_keys, max_bytes);
        Fallback { local, local_share }
    }

    /// Count the keys the local state evicts when full in `evictions`.
    pub fn counting_evictions(self, evictions: metrics::Counter) -> Fallback {
        let local = self.local.counting_evictions(evictions);
        Fallback { local, ..self }
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
                let scaled: Vec<Hit> = hits.iter().map(|h| self.scale(h)).collect();
                Some(self.local.evaluate_sync(&scaled, charging))
            }
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
        let f = Fallback::new(0.25, 100, crate::backend::memory::DEFAULT_MAX_BYTES);
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
        let f = Fallback::new(0.25, 100, crate::backend::memory::DEFAULT_MAX_BYTES);
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
