//! Where limit state lives, behind one trait: a backend takes every hit of one request and
//! evaluates them as one atomic step.
//!
//! Atomic per request is what lets a request refused by one descriptor consume nothing on
//! its others. Backends differ only in where the state is (process memory, Redis) and whose
//! clock they read; the arithmetic is the algorithms'.

pub mod breaker;
pub mod deferred;
mod lag;
pub mod leased;
pub mod measured;
pub mod memory;
pub mod overlimit_cache;
pub mod redis;
pub mod stack;

use std::future::Future;
use std::time::Instant;

use crate::decision::{BackendError, Charging, Hit, Outcome};

/// Storage for limit state.
pub trait Backend: Send + Sync + 'static {
    /// Evaluate every hit of one request atomically; one outcome per hit, in order.
    fn evaluate(
        &self,
        hits: &[Hit],
        charging: Charging,
    ) -> impl Future<Output = Result<Vec<Outcome>, BackendError>> + Send;

    /// Whether the backend answers now (for health checks).
    fn ready(&self) -> impl Future<Output = bool> + Send;
}

tokio::task_local! {
    static CALLER_DEADLINE: Instant;
}

/// Evaluate with `deadline` as the instant the caller stops waiting for the decision. A
/// backend that can tell (Redis, on its own clock) then charges nothing for a decision taken
/// later. A task-local rather than a parameter: only the backend at the bottom of the stack
/// reads it, the layers in between need not carry it.
pub async fn until<F: Future>(deadline: Instant, evaluate: F) -> F::Output {
    CALLER_DEADLINE.scope(deadline, evaluate).await
}

/// The deadline of the evaluation running in this task, if its caller set one.
pub fn caller_deadline() -> Option<Instant> {
    CALLER_DEADLINE.try_with(|deadline| *deadline).ok()
}
