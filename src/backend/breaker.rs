//! A circuit breaker around a backend: after K consecutive failures it opens and fails calls
//! at once, without touching the backend, so a dead or frozen Redis costs no request its full
//! timeout; it lets one probe through after a backoff that doubles up to a maximum, and closes
//! on the first success. Not a breaker crate: those count every error, where this one counts
//! only evidence against the backend (below).
//!
//! Only evidence that the backend fails counts, because any client can produce the rest: an
//! error the backend reported (a refused connection, an error reply), or no answer within the
//! backend's own timeout while this process ran on time. Not evidence:
//! - a call its caller abandoned (a reset stream, a dropped future, a deadline shorter than
//!   the backend's timeout): it says nothing about the backend. An abandoned probe gives its
//!   turn to the next call. So that a backend frozen while every caller gives up early
//!   (Envoy's 20 ms filter timeout against a longer Redis timeout) still opens the circuit, an
//!   abandoned call starts one independent check (`ready`, bounded by the backend's own
//!   timeout) if none is running; its result is the evidence.
//! - an answer the backend reports late ([`BackendError::Late`]: the request waited in this
//!   process, not in the backend) or refused for overload ([`BackendError::Overloaded`]:
//!   this process's queue is full): treated like an abandoned call, for the same reasons.
//! - a timeout while this process's own scheduler lagged: a saturated runtime runs timers and
//!   reads replies late, and would blame a healthy Redis for its own queue. A ticker measures
//!   how late the runtime wakes it; a timeout counts only if that lag stayed under half the
//!   time the call waited.
//!
//! A switch of the backend to a new server (a failover followed: [`Backend::switches`]) is new
//! evidence, not a retry: an open circuit closes at once, without waiting for its backoff,
//! and a call sent before the switch that fails after it says nothing of the new server.
//!
//! The failure policy (fallback) then answers the failed calls; the breaker only decides
//! whether the backend is worth asking.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::Backend;
use super::lag::Lag;
use crate::decision::{BackendError, Charging, Hit, Outcome};
use crate::ops::metrics::Metrics;

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
    /// Failing fast until `until`, then one probe may pass; or as soon as the backend
    /// switches to a new server (`switches` changes).
    Open {
        until: Instant,
        backoff: Duration,
        switches: u64,
    },
    /// One probe is in flight; everything else fails fast.
    Probing {
        backoff: Duration,
        switches: u64,
    },
}

/// Whether a call may go to the backend.
enum Admission {
    Call,
    Probe,
    Reject,
}

/// What a finished call says about the backend.
enum Evidence {
    Works,
    Fails,
    /// Neither: a full backend answers but proves little else; a lagging process proves
    /// nothing by a timeout.
    Inconclusive,
}

pub struct Breaker<B> {
    inner: Arc<B>,
    core: Arc<Core>,
}

/// What the breaker's background checks share with it.
struct Core {
    config: BreakerConfig,
    state: Mutex<State>,
    metrics: Arc<Metrics>,
    lag: Lag,
    /// An independent check of the backend is running.
    checking: AtomicBool,
}

impl<B: Backend> Breaker<B> {
    /// Must be called within a Tokio runtime (the lag ticker runs on it).
    pub fn new(inner: B, config: BreakerConfig, metrics: Arc<Metrics>) -> Breaker<B> {
        metrics.set_circuit_open(false);
        Breaker {
            inner: Arc::new(inner),
            core: Arc::new(Core {
                config,
                state: Mutex::new(State::Closed { failures: 0 }),
                metrics,
                lag: Lag::start(),
                checking: AtomicBool::new(false),
            }),
        }
    }
}

impl Core {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[cfg(test)]
    fn is_closed(&self) -> bool {
        matches!(*self.state(), State::Closed { .. })
    }

    /// Whether a call may go to the backend, which has switched servers `switches` times.
    fn admit(&self, switches: u64) -> Admission {
        let mut state = self.state();
        match *state {
            State::Closed { .. } => Admission::Call,
            State::Open { switches: then, .. } | State::Probing { switches: then, .. }
                if then != switches =>
            {
                tracing::info!("the backend switched to a new server: circuit closed");
                self.metrics.circuit_transition("closed");
                self.metrics.set_circuit_open(false);
                *state = State::Closed { failures: 0 };
                Admission::Call
            }
            State::Open {
                until,
                backoff,
                switches,
            } if Instant::now() >= until => {
                *state = State::Probing { backoff, switches };
                Admission::Probe
            }
            State::Open { .. } | State::Probing { .. } => Admission::Reject,
        }
    }

    /// A timeout is evidence only if this process kept time while the call waited.
    fn judge(&self, result: &Result<Vec<Outcome>, BackendError>, waited: Duration) -> Evidence {
        match result {
            Ok(_) => Evidence::Works,
            Err(BackendError::Full(_)) => Evidence::Inconclusive,
            Err(BackendError::Timeout) if self.lag.explains(waited) => Evidence::Inconclusive,
            Err(_) => Evidence::Fails,
        }
    }

    /// What a call sent when the backend had switched `sent` times says, now that it has
    /// switched `now` times: a failure from before a switch is about a server left behind.
    fn record(&self, evidence: Evidence, probe: bool, sent: u64, now: u64) {
        let evidence = match evidence {
            Evidence::Fails if sent != now => Evidence::Inconclusive,
            evidence => evidence,
        };
        match evidence {
            Evidence::Works => self.succeeded(),
            // A probe that meets a full backend (memory, or Redis out of memory) or a lagging
            // process closes the circuit rather than holding it half-open: the backend
            // answered, or nothing says it would not have.
            Evidence::Inconclusive if probe => self.succeeded(),
            Evidence::Inconclusive => {}
            Evidence::Fails => self.failed(probe, now),
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

    fn failed(&self, probe: bool, switches: u64) {
        let mut state = self.state();
        let open = |backoff: Duration| State::Open {
            until: Instant::now() + backoff,
            backoff,
            switches,
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
            State::Probing { backoff, .. } if probe => {
                *state = open((backoff * 2).min(self.config.max_backoff));
            }
            // A call admitted before the circuit opened failed late: nothing to change.
            State::Open { .. } | State::Probing { .. } => {}
        }
    }

    /// A call was abandoned by its caller: if it was the probe, the next call probes.
    fn abandoned(&self, probe: bool) {
        let mut state = self.state();
        if let (true, State::Probing { backoff, switches }) = (probe, *state) {
            *state = State::Open {
                until: Instant::now(),
                backoff,
                switches,
            };
        }
    }
}

/// Ask the backend whether it answers, once at a time, in the background; the answer is
/// evidence like a call's.
fn check<B: Backend>(inner: &Arc<B>, core: &Arc<Core>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    if core.checking.swap(true, Ordering::AcqRel) {
        return;
    }
    let (inner, core) = (Arc::clone(inner), Arc::clone(core));
    runtime.spawn(async move {
        let started = Instant::now();
        let sent = inner.switches();
        let result = match inner.ready().await {
            true => Ok(Vec::new()),
            false => Err(BackendError::Timeout),
        };
        let evidence = core.judge(&result, started.elapsed());
        core.record(evidence, false, sent, inner.switches());
        core.checking.store(false, Ordering::Release);
    });
}

/// Dropped before the backend answered (the caller abandoned the call), or armed still when
/// the answer says only that this process was late.
struct Abandoned<'a, B: Backend> {
    breaker: &'a Breaker<B>,
    probe: bool,
    armed: bool,
}

impl<B: Backend> Drop for Abandoned<'_, B> {
    fn drop(&mut self) {
        if self.armed {
            self.breaker.core.abandoned(self.probe);
            check(&self.breaker.inner, &self.breaker.core);
        }
    }
}

impl<B: Backend> Backend for Breaker<B> {
    async fn evaluate(
        &self,
        hits: &[Hit],
        charging: Charging,
    ) -> Result<Vec<Outcome>, BackendError> {
        let sent = self.inner.switches();
        let probe = match self.core.admit(sent) {
            Admission::Reject => return Err(BackendError::CircuitOpen),
            Admission::Probe => true,
            Admission::Call => false,
        };
        let mut abandoned = Abandoned {
            breaker: self,
            probe,
            armed: true,
        };
        let started = Instant::now();
        let result = self.inner.evaluate(hits, charging).await;
        if !matches!(result, Err(BackendError::Late | BackendError::Overloaded)) {
            abandoned.armed = false;
            let evidence = self.core.judge(&result, started.elapsed());
            self.core
                .record(evidence, probe, sent, self.inner.switches());
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
    use std::sync::atomic::{AtomicU32, AtomicU64};

    /// A backend whose behaviour the test switches, counting the calls that reach it.
    #[derive(Default)]
    struct Switch {
        /// Calls fail (a refused connection) and `ready` says no.
        down: AtomicBool,
        /// Calls wait 30 ms, then time out: a frozen backend, seen by a process keeping time.
        slow: AtomicBool,
        /// Calls never answer; only their callers end them.
        hang: AtomicBool,
        /// Calls block the runtime's thread 40 ms, then time out: a saturated process.
        stall: AtomicBool,
        /// Calls answer late: they waited in this process.
        late: AtomicBool,
        /// Servers switched to (a failover followed).
        switched: AtomicU64,
        calls: AtomicU32,
    }

    impl Backend for Arc<Switch> {
        async fn evaluate(&self, hits: &[Hit], _: Charging) -> Result<Vec<Outcome>, BackendError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.hang.load(Ordering::SeqCst) {
                std::future::pending::<()>().await;
            }
            if self.late.load(Ordering::SeqCst) {
                return Err(BackendError::Late);
            }
            if self.stall.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(40));
                return Err(BackendError::Timeout);
            }
            if self.slow.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(30)).await;
                return Err(BackendError::Timeout);
            }
            if self.down.load(Ordering::SeqCst) {
                return Err(BackendError::Unavailable("down".into()));
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

        fn switches(&self) -> u64 {
            self.switched.load(Ordering::SeqCst)
        }
    }

    fn down() -> BackendError {
        BackendError::Unavailable("down".into())
    }

    fn breaker(failures_to_open: u32) -> (Arc<Switch>, Breaker<Arc<Switch>>) {
        let switch = Arc::new(Switch::default());
        let config = BreakerConfig {
            failures_to_open,
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_millis(200),
        };
        let metrics = Arc::new(Metrics::new(0.8, 10));
        (switch.clone(), Breaker::new(switch, config, metrics))
    }

    /// Call and give up after `patience`, as a caller with a deadline does.
    async fn abandon(breaker: &Breaker<Arc<Switch>>, patience: Duration) {
        let call = breaker.evaluate(&[], Charging::Atomic);
        assert!(tokio::time::timeout(patience, call).await.is_err());
    }

    #[tokio::test]
    async fn opens_after_k_failures_probes_with_backoff_and_closes_on_success() {
        let (switch, breaker) = breaker(3);
        let call = || breaker.evaluate(&[], Charging::Atomic);

        switch.down.store(true, Ordering::SeqCst);
        for _ in 0..3 {
            assert_eq!(call().await, Err(down()));
        }
        assert_eq!(call().await, Err(BackendError::CircuitOpen));
        assert_eq!(
            switch.calls.load(Ordering::SeqCst),
            3,
            "open: the backend is not called"
        );

        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(call().await, Err(down()), "the probe reaches the backend");
        assert_eq!(
            call().await,
            Err(BackendError::CircuitOpen),
            "open again after a failed probe"
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

    /// A switch to a new server closes an open circuit at once, long before its backoff
    /// ends; and a call sent before a switch that fails after it does not count.
    #[tokio::test]
    async fn a_switch_closes_the_circuit_at_once_and_older_failures_do_not_count() {
        let (switch, breaker) = breaker(1);
        let call = || breaker.evaluate(&[], Charging::Atomic);
        switch.down.store(true, Ordering::SeqCst);
        assert_eq!(call().await, Err(down()));
        assert_eq!(call().await, Err(BackendError::CircuitOpen));
        switch.down.store(false, Ordering::SeqCst);
        switch.switched.fetch_add(1, Ordering::SeqCst);
        assert!(call().await.is_ok(), "the switch closed the circuit");
        assert!(breaker.core.is_closed());

        // A call sent to the old server whose failure comes once the new one is followed.
        breaker.core.record(Evidence::Fails, false, 1, 2);
        assert!(breaker.core.is_closed(), "a failure from before the switch");
        breaker.core.record(Evidence::Fails, false, 2, 2);
        assert!(!breaker.core.is_closed(), "a failure after it");
    }

    /// How long the circuit stays open after each failed probe: 50, 100, 200 ms, then the
    /// cap (200 ms) however many more fail. Measured by calling until a probe gets through.
    #[tokio::test]
    async fn the_backoff_doubles_after_each_failed_probe_up_to_its_cap() {
        let (switch, breaker) = breaker(1);
        switch.down.store(true, Ordering::SeqCst);
        assert_eq!(breaker.evaluate(&[], Charging::Atomic).await, Err(down()));
        let mut opened = Instant::now();
        let mut open_for = Vec::new();
        for _ in 0..5 {
            let calls = switch.calls.load(Ordering::SeqCst);
            while switch.calls.load(Ordering::SeqCst) == calls {
                let _ = breaker.evaluate(&[], Charging::Atomic).await;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            open_for.push(opened.elapsed());
            opened = Instant::now();
        }
        let seen: Vec<u128> = open_for.iter().map(Duration::as_millis).collect();
        // Each interval is seen from when this loop noticed the last probe, a little after
        // the breaker reopened: a tenth of slack, far from the next doubling.
        for (i, backoff) in [50, 100, 200, 200, 200].into_iter().enumerate() {
            assert!(seen[i] >= backoff - backoff / 10, "open {i}: {seen:?}");
        }
        // Without the cap the last two would be 400 and 800 ms.
        assert!(seen[3].min(seen[4]) < 400, "capped: {seen:?}");
    }

    /// Abandoned calls prove nothing about a healthy backend, however many; against a dead
    /// one, the independent checks they start open the circuit all the same.
    #[tokio::test]
    async fn abandoned_calls_count_only_through_an_independent_check() {
        let (switch, breaker) = breaker(3);
        switch.hang.store(true, Ordering::SeqCst);
        for _ in 0..20 {
            abandon(&breaker, Duration::from_millis(1)).await;
        }
        switch.hang.store(false, Ordering::SeqCst);
        assert!(
            breaker.evaluate(&[], Charging::Atomic).await.is_ok(),
            "20 abandoned calls left the circuit closed"
        );

        switch.hang.store(true, Ordering::SeqCst);
        switch.down.store(true, Ordering::SeqCst);
        let give_up = Instant::now() + Duration::from_secs(2);
        while breaker.core.is_closed() {
            abandon(&breaker, Duration::from_millis(1)).await;
            assert!(
                Instant::now() < give_up,
                "the checks never opened the circuit"
            );
        }
        let reached = switch.calls.load(Ordering::SeqCst);
        assert_eq!(
            breaker.evaluate(&[], Charging::Atomic).await,
            Err(BackendError::CircuitOpen)
        );
        assert_eq!(switch.calls.load(Ordering::SeqCst), reached);
    }

    /// An abandoned probe gives its turn to the next call instead of holding the circuit
    /// half-open.
    #[tokio::test]
    async fn an_abandoned_probe_lets_the_next_call_probe() {
        let (switch, breaker) = breaker(1);
        switch.down.store(true, Ordering::SeqCst);
        let call = || breaker.evaluate(&[], Charging::Atomic);
        assert_eq!(call().await, Err(down()));
        tokio::time::sleep(Duration::from_millis(60)).await;
        switch.down.store(false, Ordering::SeqCst);
        switch.hang.store(true, Ordering::SeqCst);
        abandon(&breaker, Duration::from_millis(5)).await;
        switch.hang.store(false, Ordering::SeqCst);
        assert!(call().await.is_ok(), "the next call was the probe");
    }

    /// A timeout met while the process itself could not run (its thread blocked, as on a
    /// saturated machine) does not count; the same timeout on a process keeping time does.
    #[tokio::test(flavor = "current_thread")]
    async fn a_timeout_while_this_process_lags_is_not_evidence() {
        let (switch, breaker) = breaker(1);
        tokio::time::sleep(Duration::from_millis(20)).await;
        switch.stall.store(true, Ordering::SeqCst);
        let call = || breaker.evaluate(&[], Charging::Atomic);
        for _ in 0..3 {
            assert_eq!(call().await, Err(BackendError::Timeout));
        }
        switch.stall.store(false, Ordering::SeqCst);
        switch.slow.store(true, Ordering::SeqCst);
        assert_eq!(
            call().await,
            Err(BackendError::Timeout),
            "the circuit was still closed"
        );
        assert_eq!(call().await, Err(BackendError::CircuitOpen));
        assert_eq!(switch.calls.load(Ordering::SeqCst), 4);
    }

    /// Late answers prove nothing about a healthy backend, however many, and a late probe
    /// passes its turn on; against a dead backend, the independent checks they start open the
    /// circuit all the same.
    #[tokio::test]
    async fn late_answers_are_no_evidence() {
        let (switch, breaker) = breaker(3);
        let call = || breaker.evaluate(&[], Charging::Atomic);
        switch.late.store(true, Ordering::SeqCst);
        for _ in 0..20 {
            assert_eq!(call().await, Err(BackendError::Late));
        }
        assert!(
            breaker.core.is_closed(),
            "20 late answers opened the circuit"
        );
        switch.late.store(false, Ordering::SeqCst);
        assert!(call().await.is_ok());

        switch.down.store(true, Ordering::SeqCst);
        for _ in 0..3 {
            assert_eq!(call().await, Err(down()));
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
        switch.down.store(false, Ordering::SeqCst);
        switch.late.store(true, Ordering::SeqCst);
        assert_eq!(call().await, Err(BackendError::Late), "the probe came late");
        switch.late.store(false, Ordering::SeqCst);
        assert!(call().await.is_ok(), "the next call was the probe");
        assert!(breaker.core.is_closed());

        switch.late.store(true, Ordering::SeqCst);
        switch.down.store(true, Ordering::SeqCst);
        let give_up = Instant::now() + Duration::from_secs(2);
        while breaker.core.is_closed() {
            let _ = call().await;
            tokio::time::sleep(Duration::from_millis(1)).await;
            assert!(
                Instant::now() < give_up,
                "the checks never opened the circuit"
            );
        }
    }
}
