//! The rate-limit service, top to bottom: validate the request, match its descriptors
//! against the active rules, evaluate the hits atomically in the backend, answer.
//!
//! The gRPC method and the HTTP `/json` endpoint both call `RateLimiter::check`, so they
//! can never disagree.

use std::sync::Arc;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

use crate::active::ActiveRules;
use crate::backend::{Backend, Charging, Outcome, Role};
use crate::metrics::{Metrics, RuleHit};
use crate::plan::{Decision, Plan};
use crate::request::{Bounds, CheckRequest};
use crate::response::{self, ResponseSettings};

#[derive(Debug, Clone, Default)]
pub struct Settings {
    pub bounds: Bounds,
    pub charging: Charging,
    pub response: ResponseSettings,
}

pub struct RateLimiter<B> {
    rules: Arc<ActiveRules>,
    backend: B,
    settings: Settings,
    metrics: Arc<Metrics>,
}

impl<B: Backend> RateLimiter<B> {
    pub fn new(
        rules: Arc<ActiveRules>,
        backend: B,
        settings: Settings,
        metrics: Arc<Metrics>,
    ) -> RateLimiter<B> {
        RateLimiter {
            rules,
            backend,
            settings,
            metrics,
        }
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Decide one request.
    pub async fn check(&self, request: &RateLimitRequest) -> Result<RateLimitResponse, Status> {
        let request = CheckRequest::parse(request, &self.settings.bounds).map_err(|invalid| {
            self.metrics.invalid_request.increment(1);
            Status::invalid_argument(invalid.0)
        })?;
        let loaded = self.rules.current();
        let plan = Plan::build(&loaded.rules, &request);
        if plan.unknown_domain {
            self.metrics.domain_not_found(request.domain);
        }
        let outcomes = if plan.hits.is_empty() {
            Vec::new()
        } else {
            self.backend
                .evaluate(&plan.hits, self.settings.charging)
                .await
                .map_err(|error| {
                    self.metrics.backend_error.increment(1);
                    tracing::warn!(%error, domain = request.domain, "backend error");
                    Status::unavailable(error.to_string())
                })?
        };
        self.record(&plan, &outcomes);
        let built = response::build(&plan, &outcomes, &self.settings.response);
        if built.shadowed_globally {
            self.metrics.global_shadow_mode.increment(1);
        }
        Ok(built.response)
    }

    fn record(&self, plan: &Plan<'_>, outcomes: &[Outcome]) {
        for decision in &plan.decisions {
            if let Decision::Limited(applied) = decision {
                let counters = self.metrics.rule(&applied.stats_key);
                self.metrics.record(
                    &counters,
                    RuleHit {
                        outcome: &outcomes[applied.hit],
                        limit: applied.limit.requests_per_unit,
                        hits: applied.cost,
                        shadow: applied.role == Role::Shadow,
                    },
                );
            }
        }
    }
}

#[tonic::async_trait]
impl<B: Backend> RateLimitService for RateLimiter<B> {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.check(request.get_ref()).await.map(Response::new)
    }
}
