//! The admin HTTP port: `/healthcheck`, `/json`, `/rlconfig` and `/metrics`; and, as the
//! reference has them, a debug port (`/rlconfig`) and a Prometheus port of their own.
//!
//! Each port is served over HTTP/1 from the capped accept loop of `connections`, with a bound
//! on reading a request's headers (which also closes idle keep-alive connections) and another
//! on reading its body and answering: a slow or silent client holds a connection slot for a
//! bounded time only.
//!
//! Status codes follow the reference: `/healthcheck` 200 `OK` or 500; `/json` 200 for OK,
//! 429 for OVER_LIMIT, 400 with the message for a bad body or request, 503 when the backend
//! failed (see `json::error_status`).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use metrics::Gauge;
use tokio::sync::{Semaphore, watch};

use crate::backend::Backend;
use crate::config::active::ActiveRules;
use crate::edge::connections::Incoming;
use crate::edge::health::Health;
use crate::edge::http;
use crate::edge::json;
use crate::ops::metrics::Metrics;
use crate::service::RateLimiter;

pub struct Admin<B> {
    pub limiter: Arc<RateLimiter<B>>,
    pub rules: Arc<ActiveRules>,
    pub health: Arc<Health>,
    pub metrics: Arc<Metrics>,
    pub in_flight: InFlight,
}

/// Calls in flight, read when scraped: the cap on them already counts them, so the call path
/// does no more work for the series.
pub struct InFlight {
    places: Arc<Semaphore>,
    max: usize,
    gauge: Gauge,
}

impl InFlight {
    /// Of the cap `places`, which holds `max` places.
    pub fn new(places: Arc<Semaphore>, max: usize, metrics: &Metrics) -> InFlight {
        metrics
            .gauge("turnstile_calls_in_flight_limit")
            .set(max as f64);
        InFlight {
            places,
            max,
            gauge: metrics.gauge("turnstile_calls_in_flight"),
        }
    }

    fn update(&self) {
        let taken = self.max.saturating_sub(self.places.available_permits());
        self.gauge.set(taken as f64);
    }
}

pub fn router<B: Backend>(admin: Arc<Admin<B>>) -> Router {
    Router::new()
        .route("/healthcheck", get(healthcheck::<B>))
        .route("/json", post(check_json::<B>))
        .route("/rlconfig", get(rlconfig::<B>))
        .route("/metrics", get(metrics::<B>))
        .with_state(admin)
}

/// The reference's debug port: an index and `/rlconfig`.
pub fn debug_router<B: Backend>(admin: Arc<Admin<B>>) -> Router {
    Router::new()
        .route("/", get(|| async { "/rlconfig: the rules in force\n" }))
        .route("/rlconfig", get(rlconfig::<B>))
        .with_state(admin)
}

/// Prometheus on a port of its own, at `path` (USE_PROMETHEUS).
pub fn metrics_router<B: Backend>(admin: Arc<Admin<B>>, path: &str) -> Router {
    Router::new()
        .route(path, get(metrics::<B>))
        .with_state(admin)
}

/// Serve `router` on the connections of `incoming` until `stop` turns true, then finish the
/// requests in progress and close.
pub async fn serve(
    incoming: Incoming,
    router: Router,
    read_timeout: Duration,
    stop: watch::Receiver<bool>,
) {
    let router = router.layer(middleware::from_fn(move |request: Request, next: Next| {
        bounded(read_timeout, request, next)
    }));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(read_timeout);
    http::connections(incoming, stop, None, |conn| {
        http.serve_connection(TokioIo::new(conn), TowerToHyperService::new(router.clone()))
    })
    .await;
}

/// Reading the body and answering within `limit`, or 408.
async fn bounded(limit: Duration, request: Request, next: Next) -> Response {
    tokio::time::timeout(limit, next.run(request))
        .await
        .unwrap_or_else(|_| (StatusCode::REQUEST_TIMEOUT, "request timed out\n").into_response())
}

/// The body is the reference's; headers say which rules are in force.
async fn healthcheck<B: Backend>(State(admin): State<Arc<Admin<B>>>) -> Response {
    let version = match admin.rules.arrived() {
        true => admin.rules.current().rules.version().to_owned(),
        false => "none".to_owned(),
    };
    let headers = [
        ("x-turnstile-rules-source", admin.rules.source().to_owned()),
        ("x-turnstile-rules-version", version),
    ];
    if admin.health.serving() {
        (StatusCode::OK, headers, "OK").into_response()
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, headers).into_response()
    }
}

async fn check_json<B: Backend>(
    State(admin): State<Arc<Admin<B>>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let request = match json::parse_request(&body) {
        Ok(request) => request,
        Err(error) => {
            return (StatusCode::BAD_REQUEST, format!("Bad Request: {error}")).into_response();
        }
    };
    match admin.limiter.check(&request, None, &headers).await {
        Ok(response) => {
            let status = if response.overall_code == Code::OverLimit as i32 {
                StatusCode::TOO_MANY_REQUESTS
            } else {
                StatusCode::OK
            };
            (status, axum::Json(json::response_json(&response))).into_response()
        }
        Err(status) => (json::error_status(&status), status.message().to_owned()).into_response(),
    }
}

async fn rlconfig<B: Backend>(State(admin): State<Arc<Admin<B>>>) -> Response {
    let loaded = admin.rules.current();
    let body = format!(
        "# version {} loaded {} source {}\n{}",
        loaded.rules.version(),
        humantime::format_rfc3339_seconds(loaded.loaded_at),
        admin.rules.source(),
        loaded.rules.describe()
    );
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body).into_response()
}

async fn metrics<B: Backend>(State(admin): State<Arc<Admin<B>>>) -> Response {
    admin.in_flight.update();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        admin.metrics.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_in_flight_are_the_places_taken_when_scraped() {
        let metrics = Metrics::new(0.8, 10);
        let places = Arc::new(Semaphore::new(5));
        let in_flight = InFlight::new(places.clone(), 5, &metrics);
        let taken = places.try_acquire_many(3).expect("free places");
        in_flight.update();
        let text = metrics.render();
        assert!(text.contains("turnstile_calls_in_flight 3\n"), "{text}");
        assert!(
            text.contains("turnstile_calls_in_flight_limit 5\n"),
            "{text}"
        );
        drop(taken);
        in_flight.update();
        assert!(metrics.render().contains("turnstile_calls_in_flight 0\n"));
    }
}
