//! Whether this instance should get traffic, reported on gRPC health (services "", the
//! reference's "ratelimit", and the RLS's full name) and on HTTP `/healthcheck`.
//!
//! Serving means: rules are loaded (always true once started), the backend answered its
//! last probe, and no shutdown has begun. Flipping to not-serving on SIGTERM lets load
//! balancers drain the instance before it stops.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::backend::Backend;

const SERVICES: [&str; 3] = [
    "",
    "ratelimit",
    "envoy.service.ratelimit.v3.RateLimitService",
];

pub struct Health {
    reporter: HealthReporter,
    backend_ok: AtomicBool,
    stopping: AtomicBool,
}

impl Health {
    pub fn new(reporter: HealthReporter) -> Health {
        Health {
            reporter,
            backend_ok: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
        }
    }

    pub fn serving(&self) -> bool {
        self.backend_ok.load(Ordering::Relaxed) && !self.stopping.load(Ordering::Relaxed)
    }

    async fn publish(&self) {
        let status = if self.serving() {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for service in SERVICES {
            self.reporter.set_service_status(service, status).await;
        }
    }

    pub async fn set_backend_ok(&self, ok: bool) {
        if self.backend_ok.swap(ok, Ordering::Relaxed) != ok {
            if ok {
                tracing::info!("backend answers: serving");
            } else {
                tracing::warn!("backend does not answer: not serving");
            }
            self.publish().await;
        }
    }

    pub async fn set_stopping(&self) {
        self.stopping.store(true, Ordering::Relaxed);
        self.publish().await;
    }

    /// Probe the backend every `period`, forever.
    pub async fn watch_backend<B: Backend>(&self, backend: &B, period: Duration) {
        self.publish().await;
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            self.set_backend_ok(backend.ready().await).await;
        }
    }
}
