//! The backend a server decides on, assembled here and nowhere else. A request's hits pass
//! the decorators outermost first; each sits where it does for a reason:
//!
//! | decorator        | memory | Redis | why there |
//! |------------------|--------|-------|-----------|
//! | `Breaker`        | yes    | yes   | outermost: once the backend is known to fail, a call touches nothing below it |
//! | `Leased`         | –      | yes   | spends units Redis already granted, so most calls of a leased key stop here |
//! | `OverLimitCache` | –      | yes   | refuses a key known to be over without a round trip (it can only refuse) |
//! | `Measured`       | yes    | yes   | times only real round trips: below every layer that answers locally |
//! | `Deferred`       | –      | yes   | connects in the background, so the server starts while Redis is away |
//!
//! The memory backend needs no cache, leases or deferral: every call is already local.

use std::sync::Arc;

use super::breaker::{Breaker, BreakerConfig};
use super::deferred::Deferred;
use super::leased::Leased;
use super::measured::Measured;
use super::memory::MemoryBackend;
use super::overlimit_cache::OverLimitCache;
use super::redis::RedisBackend;
use crate::ops::metrics::Metrics;

/// The memory backend's stack.
pub type MemoryStack = Breaker<Measured<MemoryBackend>>;

/// The Redis backend's stack.
pub type RedisStack = Breaker<Leased<OverLimitCache<Measured<Deferred<RedisBackend>>>>>;

/// How the decorators are sized.
pub struct StackConfig {
    pub breaker: BreakerConfig,
    /// Refusals the over-limit cache holds at most.
    pub over_limit_entries: usize,
    /// Keys with quota leases held at once.
    pub max_leases: usize,
}

pub fn memory(store: MemoryBackend, config: &StackConfig, metrics: &Arc<Metrics>) -> MemoryStack {
    let measured = Measured::new(store, metrics.clone());
    Breaker::new(measured, config.breaker, metrics.clone())
}

pub fn redis(
    store: Deferred<RedisBackend>,
    config: &StackConfig,
    metrics: &Arc<Metrics>,
) -> RedisStack {
    let measured = Measured::new(store, metrics.clone());
    let cached = OverLimitCache::new(measured, config.over_limit_entries, metrics.clone());
    let leased = Leased::new(cached, config.max_leases);
    Breaker::new(leased, config.breaker, metrics.clone())
}
