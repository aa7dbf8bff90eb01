//! The rate-limit service, top to bottom: validate the request (`request`), match its
//! descriptors against the active rules (`plan`), evaluate the hits atomically in the
//! backend (or answer as `fallback` says when it fails), answer (`response`).
//!
//! The gRPC method (`edge::grpc`) and the HTTP `/json` endpoint both call
//! `RateLimiter::check`, so they can never disagree.
//!
//! It may import `backend`, `config`, `ops`, `algorithm` and `decision`; never `edge`,
//! `rlqs` or `app`, which stand on it.

pub mod fallback;
pub mod learned;
pub mod ledger;
pub mod plan;
pub mod request;
pub mod response;

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use http::HeaderMap;
use tonic::Status;
use tracing::Span;

use crate::backend::Backend;
use crate::config::active::ActiveRules;
use crate::decision::FailurePolicy;
use crate::decision::deadline::Deadline;
use crate::decision::{BackendError, Charging, Outcome, Role};
use crate::ops::metrics::{Metrics, RuleHit};
use crate::ops::telemetry;
use crate::service::fallback::{Fallback, Settled};
use crate::service::plan::{Decision, Plan};
use crate::service::request::{Bounds, CheckRequest};
use crate::service::response::ResponseSettings;

#[derive(Debug, Clone)]
pub struct Settings {
    pub bounds: Bounds,
    pub charging: Charging,
    pub response: ResponseSettings,
    /// What to answer when the backend fails, unless a domain's rules say otherwise.
    pub on_backend_error: FailurePolicy,
    /// Every limit is a soft (quota-mode) limit.
    pub quota_mode: bool,
    /// How long a caller that sets no deadline of its own (no `grpc-timeout`; `/json`) is
    /// taken to wait: as long as a call may last at all.
    pub request_timeout: Duration,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            bounds: Bounds::default(),
            charging: Charging::default(),
            response: ResponseSettings::default(),
            on_backend_error: FailurePolicy::default(),
            quota_mode: false,
            // The command line's default: a zero here would time every decision out.
            request_timeout: Duration::from_secs(1),
        }
    }
}

pub struct RateLimiter<B> {
    rules: Arc<ActiveRules>,
    backend: B,
    fallback: Fallback,
    settings: Settings,
    metrics: Arc<Metrics>,
}

impl<B: Backend> RateLimiter<B> {
    pub fn new(
        rules: Arc<ActiveRules>,
        backend: B,
        fallback: Fallback,
        settings: Settings,
        metrics: Arc<Metrics>,
    ) -> RateLimiter<B> {
        RateLimiter {
            rules,
            backend,
            fallback,
            settings,
            metrics,
        }
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The longest a call may take: how long a caller without a deadline of its own is taken
    /// to wait, and the most a caller's own deadline is given.
    pub fn request_timeout(&self) -> Duration {
        self.settings.request_timeout
    }

    /// Decide one request. `deadline` (the caller's; without one, the request timeout's)
    /// bounds the backend call: past it the failure policy answers, while the caller still
    /// listens, and the backend charges nothing for a decision it would take later. Too
    /// little time left to ask the backend at all is answered by the policy at once.
    /// `headers` are the call's: a trace context in them is the decision span's parent.
    pub async fn check(
        &self,
        request: &RateLimitRequest,
        deadline: Option<Deadline>,
        headers: &HeaderMap,
    ) -> Result<RateLimitResponse, Status> {
        let span = telemetry::decision_span(headers);
        span.record("domain", request.domain.as_str());
        let answer = self.decide(request, deadline, &span).await;
        match &answer {
            Ok(response) => {
                span.record("outcome", overall_code_name(response.overall_code));
            }
            Err(status) => {
                span.record("outcome", tracing::field::debug(status.code()));
                span.record("otel.status_code", "ERROR");
            }
        }
        answer
    }

    async fn decide(
        &self,
        request: &RateLimitRequest,
        deadline: Option<Deadline>,
        span: &Span,
    ) -> Result<RateLimitResponse, Status> {
        let original = request;
        let request = CheckRequest::parse(request, &self.settings.bounds).map_err(|invalid| {
            self.metrics.invalid_request.increment(1);
            Status::invalid_argument(invalid.0)
        })?;
        let loaded = self.rules.current();
        let mut plan = Plan::build(&loaded.rules, &request);
        if self.settings.quota_mode {
            plan = plan.into_quota_mode();
        }
        if plan.unknown_domain {
            self.metrics.domain_not_found(request.domain);
        }
        let outcomes = if plan.hits.is_empty() {
            Vec::new()
        } else {
            let deadline =
                deadline.unwrap_or_else(|| Deadline::for_call(self.settings.request_timeout));
            let local = plan
                .on_backend_error
                .unwrap_or(self.settings.on_backend_error)
                == FailurePolicy::Local;
            // The backend's future is made where it is bound, not kept in a local first: a
            // local moved into a future still takes its own room in this one.
            let evaluated = if deadline.remaining() < MIN_BUDGET {
                Err(BackendError::Timeout)
            } else if local
                && self.fallback.owes()
                && let Settled::Owing(error) = self.fallback.settle(&self.backend, deadline).await
            {
                // What this instance admitted alone reaches the backend before it decides
                // from the backend again.
                Err(error)
            } else {
                // Timed only when something listens to the span.
                let started = (!span.is_disabled()).then(Instant::now);
                let evaluated = deadline
                    .bound(self.backend.evaluate(&plan.hits, self.settings.charging))
                    .await
                    .unwrap_or(Err(BackendError::Timeout));
                if let Some(started) = started {
                    span.record("backend_time_us", started.elapsed().as_micros() as u64);
                }
                evaluated
            };
            match evaluated {
                Ok(mut outcomes) => {
                    if local {
                        self.fallback.learn(&plan.hits, &outcomes);
                        let charging = self.settings.charging;
                        self.fallback
                            .within_share(&plan.hits, &mut outcomes, charging);
                    }
                    outcomes
                }
                Err(error) => {
                    span.record("backend_error", tracing::field::display(&error));
                    self.on_backend_error(&plan, request.domain, error)?
                }
            }
        };
        self.record(&plan, &outcomes);
        let built = response::build(original, &plan, &outcomes, &self.settings.response);
        if built.shadowed_globally {
            self.metrics.global_shadow_mode.increment(1);
        }
        Ok(built.response)
    }

    /// Answer by the failure policy (the domain's, else the global one).
    fn on_backend_error(
        &self,
        plan: &Plan<'_>,
        domain: &str,
        error: BackendError,
    ) -> Result<Vec<Outcome>, Status> {
        self.metrics.backend_error(&error);
        let policy = plan
            .on_backend_error
            .unwrap_or(self.settings.on_backend_error);
        // Per request, so not above debug: an outage would flood the log. The breaker logs
        // its transitions, and the metrics count every answer by policy.
        tracing::debug!(%error, domain, %policy, "backend error; answering by policy");
        let unavailable = |error: BackendError| Status::unavailable(error.to_string());
        let outcomes = self
            .fallback
            .outcomes(policy, &plan.hits, self.settings.charging)
            .ok_or_else(|| unavailable(error))?
            .map_err(unavailable)?;
        self.metrics.fallback_answers.increment(1);
        Ok(outcomes)
    }

    fn record(&self, plan: &Plan<'_>, outcomes: &[Outcome]) {
        for decision in &plan.decisions {
            if let Decision::Limited(applied) = decision {
                let counters = self.metrics.rule(&applied.stats_key);
                let (limit, outcome) = plan.decisive(applied, outcomes);
                self.metrics.record(
                    &counters,
                    RuleHit {
                        outcome,
                        limit: limit.requests_per_unit,
                        hits: applied.cost,
                        shadow: applied.role == Role::Shadow,
                    },
                );
            }
        }
    }
}

/// The answer's overall code as the protocol names it, for the decision span.
fn overall_code_name(code: i32) -> &'static str {
    Code::try_from(code).map_or("UNKNOWN", |code| code.as_str_name())
}

/// Below this no backend answers in time (a Redis round trip on the same host takes about
/// a tenth of it): the call is not worth sending.
const MIN_BUDGET: Duration = Duration::from_micros(500);
