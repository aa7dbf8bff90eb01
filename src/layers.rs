//! Tower layers around the gRPC server, so handlers hold only the rate-limit logic: call
//! counts and latency per method, and a cap on calls in flight that refuses the excess at
//! once with RESOURCE_EXHAUSTED instead of queueing it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use tower::{Layer, Service};

use crate::metrics::Metrics;

/// Counts calls and observes their latency, per gRPC method (the last path segment).
#[derive(Clone)]
pub struct GrpcMetricsLayer {
    metrics: Arc<Metrics>,
}

impl GrpcMetricsLayer {
    pub fn new(metrics: Arc<Metrics>) -> GrpcMetricsLayer {
        GrpcMetricsLayer { metrics }
    }
}

impl<S> Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetrics<S>;

    fn layer(&self, inner: S) -> GrpcMetrics<S> {
        GrpcMetrics {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

#[derive(Clone)]
pub struct GrpcMetrics<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S, B> Service<http::Request<B>> for GrpcMetrics<S>
where
    S: Service<http::Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let method = self.metrics.grpc_method(request.uri().path());
        let started = Instant::now();
        let call = self.inner.call(request);
        Box::pin(async move {
            let result = call.await;
            method.observe(started.elapsed());
            result
        })
    }
}
