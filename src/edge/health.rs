//! Whether this instance should get traffic, reported on gRPC health (services "", the
//! reference's "ratelimit", and the RLS's full name) and on HTTP `/healthcheck`.
//!
//! Serving means: no shutdown has begun (flipping to not-serving on SIGTERM lets load
//! balancers drain the instance before it stops); the backend has answered since start-up
//! (so a new instance gets traffic only once connected) and, when the failure policy is
//! `error`, answered its last probe too (with any other policy the instance answers as
//! configured while the backend is away, and taking it out of rotation would defeat the
//! policy); with HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED, the rules define a domain; and rules
//! from a control plane have arrived at least once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use std::sync::Arc;

use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::backend::Backend;
use crate::config::active::ActiveRules;

const SERVICES: [&str; 3] = [
    "",
    "ratelimit",
    "envoy.service.ratelimit.v3.RateLimitService",
];

/// What health depends on besides shutdown.
pub struct Requirements {
    /// The backend must answer (the failure policy is `error`).
    pub backend: bool,
    /// The rules in force must define at least one domain.
    pub rules: Option<Arc<ActiveRules>>,
    /// Rules that arrive after start-up (xDS): not serving until the first set has.
    pub awaited: Option<Arc<ActiveRules>>,
}

pub struct Health {
    reporter: HealthReporter,
    requirements: Requirements,
    backend_ok: AtomicBool,
    /// The backend has answered at least once.
    backend_seen: AtomicBool,
    stopping: AtomicBool,
    published: AtomicBool,
}

impl Health {
    pub fn new(reporter: HealthReporter, requirements: Requirements) -> Health {
        Health {
            reporter,
            requirements,
            backend_ok: AtomicBool::new(false),
            backend_seen: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            published: AtomicBool::new(false),
        }
    }

    pub fn serving(&self) -> bool {
        let rules_ok = self
            .requirements
            .rules
            .as_ref()
            .is_none_or(|rules| rules.current().rules.domains().next().is_some())
            && self
                .requirements
                .awaited
                .as_ref()
                .is_none_or(|rules| rules.arrived());
        let backend_ok = self.backend_ok.load(Ordering::Relaxed);
        let backend_seen = self.backend_seen.load(Ordering::Relaxed);
        (backend_ok || (backend_seen && !self.requirements.backend))
            && rules_ok
            && !self.stopping.load(Ordering::Relaxed)
    }

    async fn publish(&self) {
        let serving = self.serving();
        self.published.store(serving, Ordering::Relaxed);
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for service in SERVICES {
            self.reporter.set_service_status(service, status).await;
        }
    }

    pub async fn set_backend_ok(&self, ok: bool) {
        if ok {
            self.backend_seen.store(true, Ordering::Relaxed);
        }
        if self.backend_ok.swap(ok, Ordering::Relaxed) != ok {
            if ok {
                tracing::info!("backend answers");
            } else {
                tracing::warn!("backend does not answer");
            }
        }
        if self.serving() != self.published.load(Ordering::Relaxed) {
            self.publish().await;
        }
    }

    pub async fn set_stopping(&self) {
        self.stopping.store(true, Ordering::Relaxed);
        self.publish().await;
    }

    /// Probe the backend (and re-evaluate the rules' part) every `period`, forever.
    pub async fn watch_backend<B: Backend>(&self, backend: &B, period: Duration) {
        self.publish().await;
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            self.set_backend_ok(backend.ready().await).await;
        }
    }
}
