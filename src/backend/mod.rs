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

    /// How many times the backend has switched to a new server that answers (a failover
    /// followed, a slot's new owner found). A change is evidence that the backend works
    /// again, newer than the failures before it.
    fn switches(&self) -> u64 {
        0
    }
}
