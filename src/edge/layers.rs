//! Tower layers around the gRPC server, so handlers hold only the rate-limit logic: call
//! counts and latency per method, and a cap on calls in flight that refuses the excess at
//! once with RESOURCE_EXHAUSTED instead of queueing it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use pin_project_lite::pin_project;
use tower::{Layer, Service};

use crate::ops::metrics::{GrpcMethod, Metrics};

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
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Observed<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        Observed {
            method: Metrics::grpc_method(request.uri().path()),
            started: Instant::now(),
            metrics: Arc::clone(&self.metrics),
            call: self.inner.call(request),
        }
    }
}

pin_project! {
    /// A call, observed once it is answered (not boxed: every call has one).
    pub struct Observed<F> {
        #[pin]
        call: F,
        method: GrpcMethod,
        started: Instant,
        metrics: Arc<Metrics>,
    }
}

impl<F: Future> Future for Observed<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let answered = std::task::ready!(this.call.poll(cx));
        this.metrics.observe(*this.method, this.started.elapsed());
        Poll::Ready(answered)
    }
}
