//! Prometheus metrics under the reference's stat names, so existing dashboards keep working.
//!
//! The reference's statsd names (`ratelimit.service.rate_limit.<domain>.<key>.total_hits`)
//! map to `ratelimit_service_rate_limit_total_hits{domain, key}`, as its default Prometheus
//! mapping does. Series whose labels come from requests (detailed metrics, unknown domains)
//! are capped: past the cap they fold into one `_overflow_` series, so clients cannot grow
//! memory without bound.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use std::time::Duration;

use metrics::{
    Counter, CounterFn, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString,
    Unit,
};
use metrics_exporter_prometheus::PrometheusRecorder;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::backend::{BackendError, Outcome};
use crate::statsd::StatsdRecorder;

/// gRPC methods with their own series; any other path is counted as "other".
const GRPC_METHODS: [&str; 4] = ["ShouldRateLimit", "Check", "Watch", "other"];

/// Latency buckets, in seconds: a decision should take well under a millisecond.
const LATENCY_BUCKETS: [f64; 12] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// Default cap on series whose labels come from requests.
pub const DEFAULT_MAX_SERIES: usize = 10_000;

const OVERFLOW: &str = "_overflow_";

/// Per-rule counters, the reference's set plus `within_limit`.
pub struct RuleCounters {
    total_hits: Counter,
    over_limit: Counter,
    near_limit: Counter,
    within_limit: Counter,
    shadow_mode: Counter,
}

/// What one evaluated hit adds to its rule's counters.
pub struct RuleHit<'a> {
    pub outcome: &'a Outcome,
    pub limit: u32,
    pub hits: u64,
    pub shadow: bool,
}

/// Calls and latency of one gRPC method.
#[derive(Clone)]
pub struct MethodMetrics {
    total_requests: Counter,
    response_time: Histogram,
}

impl MethodMetrics {
    pub fn observe(&self, elapsed: Duration) {
        self.total_requests.increment(1);
        self.response_time.record(elapsed.as_secs_f64());
    }
}

pub struct Metrics {
    /// Prometheus, and statsd when exported.
    recorder: Recorders,
    methods: Vec<MethodMetrics>,
    handle: PrometheusHandle,
    near_limit_ratio: f64,
    max_series: usize,
    rules: Mutex<HashMap<String, Arc<RuleCounters>>>,
    domains_not_found: Mutex<HashMap<String, Counter>>,
    pub config_load_success: Counter,
    pub config_load_error: Counter,
    pub global_shadow_mode: Counter,
    pub invalid_request: Counter,
    backend_errors: Vec<Counter>,
    pub backend_latency: Histogram,
    pub fallback_answers: Counter,
    pub local_cache_hits: Counter,
    circuit_open: Gauge,
}

/// A counter handle, registered directly on our recorder (no global recorder, so several
/// services can live in one process, as in tests).
/// Prometheus, plus statsd for counters when it is exported.
struct Recorders {
    prometheus: PrometheusRecorder,
    statsd: Option<StatsdRecorder>,
}

/// One counter counted by both recorders.
struct Both(Counter, Counter);

impl CounterFn for Both {
    fn increment(&self, value: u64) {
        self.0.increment(value);
        self.1.increment(value);
    }

    fn absolute(&self, value: u64) {
        self.0.absolute(value);
        self.1.absolute(value);
    }
}

impl Recorder for Recorders {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prometheus.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prometheus.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.prometheus.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        let prometheus = self.prometheus.register_counter(key, metadata);
        match &self.statsd {
            Some(statsd) => Counter::from_arc(Arc::new(Both(
                prometheus,
                statsd.register_counter(key, metadata),
            ))),
            None => prometheus,
        }
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        self.prometheus.register_gauge(key, metadata)
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        self.prometheus.register_histogram(key, metadata)
    }
}

/// The series for `key` in `series`, made on first use; past `max` series, new keys share
/// one `_overflow_` series, so request-driven labels cannot grow memory without bound.
fn capped<T: Clone>(
    series: &Mutex<HashMap<String, T>>,
    key: &str,
    max: usize,
    make: impl FnOnce(&str) -> T,
) -> T {
    let mut series = series.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(found) = series.get(key) {
        return found.clone();
    }
    let key = if series.len() >= max { OVERFLOW } else { key };
    series
        .entry(key.to_owned())
        .or_insert_with(|| make(key))
        .clone()
}

static METADATA: Metadata<'static> = Metadata::new(module_path!(), metrics::Level::INFO, None);

fn counter(recorder: &dyn Recorder, name: &'static str, labels: Vec<Label>) -> Counter {
    recorder.register_counter(&Key::from_parts(name, labels), &METADATA)
}

impl Metrics {
    pub fn new(near_limit_ratio: f64, max_series: usize) -> Metrics {
        Metrics::with_statsd(near_limit_ratio, max_series, None)
    }

    /// Metrics that are also exported to statsd through `statsd`.
    pub fn with_statsd(
        near_limit_ratio: f64,
        max_series: usize,
        statsd: Option<StatsdRecorder>,
    ) -> Metrics {
        let prometheus = PrometheusBuilder::new()
            .set_buckets(&LATENCY_BUCKETS)
            .expect("static, non-empty buckets")
            .build_recorder();
        let handle = prometheus.handle();
        let recorder = Recorders { prometheus, statsd };
        let plain = |name| counter(&recorder, name, Vec::new());
        let methods = GRPC_METHODS
            .iter()
            .map(|&method| {
                let label = || vec![Label::new("grpc_method", method)];
                MethodMetrics {
                    total_requests: counter(&recorder, "ratelimit_service_total_requests", label()),
                    response_time: recorder.register_histogram(
                        &Key::from_parts("ratelimit_service_response_time_seconds", label()),
                        &METADATA,
                    ),
                }
            })
            .collect();
        Metrics {
            methods,
            config_load_success: plain("ratelimit_service_config_load_success"),
            config_load_error: plain("ratelimit_service_config_load_error"),
            global_shadow_mode: plain("ratelimit_service_global_shadow_mode"),
            invalid_request: counter(
                &recorder,
                "ratelimit_service_should_rate_limit_error",
                vec![Label::new("err_type", "invalid_argument")],
            ),
            backend_errors: BackendError::KINDS
                .iter()
                .map(|&kind| {
                    counter(
                        &recorder,
                        "ratelimit_service_should_rate_limit_error",
                        vec![Label::new("err_type", kind)],
                    )
                })
                .collect(),
            backend_latency: recorder.register_histogram(
                &Key::from_name("turnstile_backend_latency_seconds"),
                &METADATA,
            ),
            fallback_answers: plain("turnstile_backend_fallback_answers"),
            local_cache_hits: plain("ratelimit_service_rate_limit_over_limit_with_local_cache"),
            circuit_open: recorder
                .register_gauge(&Key::from_name("turnstile_backend_circuit_open"), &METADATA),
            recorder,
            handle,
            near_limit_ratio,
            max_series,
            rules: Mutex::default(),
            domains_not_found: Mutex::default(),
        }
    }

    /// Fold recorded latency samples into their buckets every `period`, until the metrics are
    /// dropped. The recorder keeps every histogram sample until it is folded, which otherwise
    /// only a scrape of /metrics does: without one, memory grew by about 50 bytes per call.
    pub fn spawn_upkeep(self: &Arc<Self>, period: Duration) {
        let metrics = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                let Some(metrics) = metrics.upgrade() else {
                    return;
                };
                metrics.handle.run_upkeep();
            }
        });
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        self.handle.render()
    }

    /// Counters for a stats key `<domain>.<rest>`, created on first use.
    pub fn rule(&self, stats_key: &str) -> Arc<RuleCounters> {
        capped(&self.rules, stats_key, self.max_series, |stats_key| {
            self.rule_counters(stats_key)
        })
    }

    fn rule_counters(&self, stats_key: &str) -> Arc<RuleCounters> {
        let (domain, key) = stats_key.split_once('.').unwrap_or((stats_key, ""));
        let make = |name| {
            counter(
                &self.recorder,
                name,
                vec![
                    Label::new("domain", domain.to_owned()),
                    Label::new("key", key.to_owned()),
                ],
            )
        };
        Arc::new(RuleCounters {
            total_hits: make("ratelimit_service_rate_limit_total_hits"),
            over_limit: make("ratelimit_service_rate_limit_over_limit"),
            near_limit: make("ratelimit_service_rate_limit_near_limit"),
            within_limit: make("ratelimit_service_rate_limit_within_limit"),
            shadow_mode: make("ratelimit_service_rate_limit_shadow_mode"),
        })
    }

    /// Count one hit on a rule, with the reference's near-limit arithmetic: the part of an
    /// admitted hit above `floor(limit * NEAR_LIMIT_RATIO)` is near the limit.
    pub fn record(&self, counters: &RuleCounters, hit: RuleHit<'_>) {
        counters.total_hits.increment(hit.hits);
        if hit.outcome.admitted {
            counters.within_limit.increment(hit.hits);
            let limit = u64::from(hit.limit);
            let after = limit.saturating_sub(u64::from(hit.outcome.remaining));
            let before = after.saturating_sub(hit.hits);
            let threshold = (limit as f64 * self.near_limit_ratio).floor() as u64;
            counters
                .near_limit
                .increment(after.saturating_sub(threshold.max(before)));
        } else {
            counters.over_limit.increment(hit.hits);
            if hit.shadow {
                counters.shadow_mode.increment(hit.hits);
            }
        }
    }

    /// Usage an RLQS client reports for a rule, counted as the rule's hits: allowed ones
    /// within the limit, denied ones over it.
    pub fn record_usage(&self, counters: &RuleCounters, allowed: u64, denied: u64) {
        counters
            .total_hits
            .increment(allowed.saturating_add(denied));
        counters.within_limit.increment(allowed);
        counters.over_limit.increment(denied);
    }

    /// A counter of another module, on these recorders.
    pub fn counter(&self, name: &'static str, labels: Vec<Label>) -> Counter {
        counter(&self.recorder, name, labels)
    }

    pub fn gauge(&self, name: &'static str) -> Gauge {
        self.recorder
            .register_gauge(&Key::from_name(name), &METADATA)
    }

    /// Count a failed backend call by its kind.
    pub fn backend_error(&self, error: &BackendError) {
        let kind = error.kind();
        if let Some(i) = BackendError::KINDS.iter().position(|k| *k == kind) {
            self.backend_errors[i].increment(1);
        }
    }

    /// Series for the gRPC method of a request path (`/package.Service/Method`).
    pub fn grpc_method(&self, path: &str) -> MethodMetrics {
        let method = path.rsplit('/').next().unwrap_or_default();
        let index = GRPC_METHODS
            .iter()
            .position(|m| *m == method)
            .unwrap_or(GRPC_METHODS.len() - 1);
        self.methods[index].clone()
    }

    /// The circuit breaker moved to `state` ("open" or "closed").
    pub fn circuit_transition(&self, state: &'static str) {
        counter(
            &self.recorder,
            "turnstile_backend_circuit_transitions",
            vec![Label::new("state", state)],
        )
        .increment(1);
    }

    pub fn set_circuit_open(&self, open: bool) {
        self.circuit_open.set(if open { 1.0 } else { 0.0 });
    }

    pub fn domain_not_found(&self, domain: &str) {
        capped(&self.domains_not_found, domain, self.max_series, |domain| {
            counter(
                &self.recorder,
                "ratelimit_service_rate_limit_domain_not_found",
                vec![Label::new("domain", domain.to_owned())],
            )
        })
        .increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn outcome(admitted: bool, remaining: u32) -> Outcome {
        Outcome {
            admitted,
            remaining,
            reset_after: Duration::from_secs(1),
        }
    }

    #[test]
    fn rule_counters_follow_the_reference_arithmetic() {
        let m = Metrics::new(0.8, 100);
        let rule = m.rule("dom.key1_value1.subkey1");
        // limit 10: the 9th and 10th hits are near the limit (threshold 8).
        for remaining in (0..10).rev() {
            let o = outcome(true, remaining);
            m.record(
                &rule,
                RuleHit {
                    outcome: &o,
                    limit: 10,
                    hits: 1,
                    shadow: false,
                },
            );
        }
        let over = outcome(false, 0);
        m.record(
            &rule,
            RuleHit {
                outcome: &over,
                limit: 10,
                hits: 3,
                shadow: true,
            },
        );
        let text = m.render();
        let line = |name: &str| {
            let prefix = format!("{name}{{domain=\"dom\",key=\"key1_value1.subkey1\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix))
                .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
                .to_owned()
        };
        assert_eq!(line("ratelimit_service_rate_limit_total_hits"), "13");
        assert_eq!(line("ratelimit_service_rate_limit_within_limit"), "10");
        assert_eq!(line("ratelimit_service_rate_limit_near_limit"), "2");
        assert_eq!(line("ratelimit_service_rate_limit_over_limit"), "3");
        assert_eq!(line("ratelimit_service_rate_limit_shadow_mode"), "3");
    }

    #[test]
    fn request_driven_series_are_capped() {
        let m = Metrics::new(0.8, 3);
        for i in 0..50 {
            m.rule(&format!("d.user_{i}"));
            m.domain_not_found(&format!("nope{i}"));
        }
        let text = m.render();
        let series = |name: &str| text.lines().filter(|l| l.starts_with(name)).count();
        assert_eq!(series("ratelimit_service_rate_limit_total_hits{"), 4);
        assert_eq!(series("ratelimit_service_rate_limit_domain_not_found{"), 4);
        assert!(text.contains(OVERFLOW));
    }
}
