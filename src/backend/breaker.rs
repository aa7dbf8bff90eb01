//! A circuit breaker around a backend: after K consecutive failures (errors or timeouts) it
//! opens and fails calls at once, without touching the backend, so a dead or frozen Redis
//! costs no request its full timeout; it lets one probe through after a backoff that doubles
//! up to a maximum, and closes on the first success.
//!
//! The failure policy (fallback) then answers the failed calls; the breaker only decides
//! whether the backend is worth asking.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{Backend, BackendError, Charging, Hit, Outcome};
use crate::metrics::Metrics;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the circuit.
    pub failures_to_open: u32,
    /// Wait before the first probe; doubled after each failed probe.
    pub initial_backoff: Duration,
    /// Longest wait between probes: bounds the time to recover once the backend is back.
    pub max_backoff: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures_to_open: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed {
        failures: u32,
    },
    /// Failing fast until `until`, then one probe may pass.
    Open {
        until: Instant,
        backoff: Duration,
    },
    /// One probe is in flight; everything else fails fast.
    Probing {
        backoff: Duration,
    },
}

/// Whether a call may go to the backend.
enum Admission {
    Call,
    Probe,
    Reject,
}

pub struct Breaker<B> {
    inner: B,
    config: BreakerConfig,
    state: Mutex<State>,
    metrics: Arc<Metrics>,
}

impl<B: Backend> Breaker<B> {
    pub fn new(inner: B, config: BreakerConfig, metrics: Arc<Metrics>) -> Breaker<B> {
        metrics.set_circuit_open(false);
        Breaker {
            inner,
            config,
            state: Mutex::new(State::Closed { failures: 0 }),
            metrics,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn admit(&self) -> Admission {
        let mut state = self.state();
        match *state {
            State::Closed { .. } => Admission::Call,
            State::Open { until, backoff } if Instant::now() >= until => {
                *state = State::Probing { backoff };
                Admission::Probe
            }
            State::Open { .. } | State::Probing { .. } => Admission::Reject,
        }
    }

    fn succeeded(&self) {
        let mut state = self.state();
        if !matches!(*state, State::Closed { .. }) {
            tracing::info!("backend answers again: circuit closed");
            self.metrics.circuit_transition("closed");
            self.metrics.set_circuit_open(false);
        }
        *state = State::Closed { failures: 0 };
    }

    fn failed(&self, probe: bool) {
        let mut state = self.state();
        let open = |backoff: Duration| State::Open {
            until: Instant::now() + backoff,
            backoff,
        };
        match *state {
            State::Closed { failures } if failures + 1 >= self.config.failures_to_open => {
                tracing::warn!(failures = failures + 1, "backend failing: circuit open");
                self.metrics.circuit_transition("open");
                self.metrics.set_circuit_open(true);
                *state = open(self.config.initial_backoff);
            }
            State::Closed { failures } => {
                *state = State::Closed {
                    failures: failures + 1,
                }
            }
            State::Probing { backoff } if probe => {
                *state = open((backoff * 2).min(self.config.max_backoff));
            }
            // A call admitted before the circuit opened failed late: nothing to change.
            State::Open { .. } | State::Probing { .. } => {}
        }
    }
}

/// A call dropped before the backend answered (its deadline passed first, or its client went
/// away) counts as a failure: a frozen backend must still open the circuit when every caller
/// gives up before the backend timeout, and a dropped probe must not leave the breaker
/// half-open for ever.
struct Unfinished<'a, B: Backend> {
    breaker: &'a Breaker<B>,
    probe: bool,
    armed: bool,
}

impl<B: Backend> Drop for Unfinished<'_, B> {
    fn drop(&mut self) {
        if self.armed {
            self.breaker.failed(self.probe);
        }
    }
}

impl<B: Backend> Backend for Breaker<B> {
    async fn evaluate(
        &self,
        hits: &[Hit],
        charging: Charging,
    ) -> Result<Vec<Outcome>, BackendError> {
        let probe = match self.admit() {
            Admission::Reject => return Err(BackendError::CircuitOpen),
            Admission::Probe => true,
            Admission::Call => false,
        };
        let mut unfinished = Unfinished {
            breaker: self,
            probe,
            armed: true,
        };
        let result = self.inner.evaluate(hits, charging).await;
        unfinished.armed = false;
        match &result {
            Ok(_) => self.succeeded(),
            // A full backend (memory, or Redis out of memory) is not a failing one: it
            // answers, so a probe that meets it closes the circuit rather than holding it
            // half-open.
            Err(BackendError::Full(_)) if probe => self.succeeded(),
            Err(BackendError::Full(_)) => {}
            Err(_) => self.failed(probe),
        }
        result
    }

    async fn ready(&self) -> bool {
        self.inner.ready().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    /// A backend whose health the test switches, counting the calls that reach it.
    #[derive(Default)]
    struct Switch {
        down: AtomicBool,
        calls: AtomicU32,
    }

    impl Backend for Arc<Switch> {
        async fn evaluate(&self, hits: &[Hit], _: Charging) -> Result<Vec<Outcome>, BackendError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                return Err(BackendError::Timeout);
            }
            Ok(hits
                .iter()
                .map(|_| Outcome {
                    admitted: true,
                    remaining: 0,
                    reset_after: Duration::ZERO,
                })
                .collect())
        }

        async fn ready(&self) -> bool {
            !self.down.load(Ordering::SeqCst)
        }
    }

    #[tokio::test]
    async fn opens_after_k_failures_probes_with_backoff_and_closes_on_success() {
        let switch = Arc::new(Switch::default());
        let config = BreakerConfig {
            failures_to_open: 3,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(200),
        };
        let breaker = Breaker::new(switch.clone(), config, Arc::new(Metrics::new(0.8, 10)));
        let call = || breaker.evaluate(&[], Charging::Atomic);

        switch.down.store(true, Ordering::SeqCst);
        for _ in 0..3 {
            assert_eq!(call().await, Err(BackendError::Timeout));
        }
        assert_eq!(call().await, Err(BackendError::CircuitOpen));
        assert_eq!(
            switch.calls.load(Ordering::SeqCst),
            3,
            "open: the backend is not called"
        );

        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(
            call().await,
            Err(BackendError::Timeout),
            "the probe reaches the backend"
        );
        assert_eq!(
            call().await,
            Err(BackendError::CircuitOpen),
            "backoff doubled"
        );
        assert_eq!(switch.calls.load(Ordering::SeqCst), 4);

        switch.down.store(false, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(110)).await;
        assert!(
            call().await.is_ok(),
            "a successful probe closes the circuit"
        );
        assert!(call().await.is_ok());
        assert_eq!(switch.calls.load(Ordering::SeqCst), 6);
    }
}
