//! Backend latency, measured around the real backend (inside the over-limit cache and the
//! circuit breaker, so only real round trips are timed).

use std::sync::Arc;
use std::time::Instant;

use super::Backend;
use crate::decision::{BackendError, Charging, Hit, Outcome};
use crate::ops::metrics::Metrics;

pub struct Measured<B> {
    inner: B,
    metrics: Arc<Metrics>,
}

impl<B: Backend> Measured<B> {
    pub fn new(inner: B, metrics: Arc<Metrics>) -> Measured<B> {
        Measured { inner, metrics }
    }
}

impl<B: Backend> Backend for Measured<B> {
    async fn evaluate(
        &self,
        hits: &[Hit],
        charging: Charging,
    ) -> Result<Vec<Outcome>, BackendError> {
        let started = Instant::now();
        let result = self.inner.evaluate(hits, charging).await;
        self.metrics
            .backend_latency
            .record(started.elapsed().as_secs_f64());
        result
    }

    async fn ready(&self) -> bool {
        self.inner.ready().await
    }

    fn switches(&self) -> u64 {
        self.inner.switches()
    }
}
