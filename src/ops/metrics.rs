//! Prometheus metrics under the reference's stat names, so existing dashboards keep working.
//!
//! The reference's statsd names (`ratelimit.service.rate_limit.<domain>.<key>.total_hits`)
//! map to `ratelimit_service_rate_limit_total_hits{domain, key}`, as its default Prometheus
//! mapping does. Series of configured rules always exist: the rules bound their number.
//! Series whose labels come from requests (detailed metrics, overrides, unknown domains) have
//! a budget of their own, in series and in bytes (a label is up to a descriptor's few KiB):
//! past it they fold into one `_overflow_` series, so clients can neither grow memory without
//! bound nor take the series of real rules away.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use std::time::Duration;

use metrics::{
    Counter, CounterFn, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString,
    Unit,
};
use metrics_exporter_prometheus::PrometheusRecorder;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::decision::{BackendError, Outcome};
use crate::ops::statsd::StatsdRecorder;

/// gRPC methods with their own series; any other path is counted as "other".
const GRPC_METHODS: [&str; 4] = ["ShouldRateLimit", "Check", "Watch", "other"];

/// Latency buckets, in seconds: a decision should take well under a millisecond.
const LATENCY_BUCKETS: [f64; 12] = [
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// Default cap on series whose labels come from requests.
pub const DEFAULT_MAX_SERIES: usize = 10_000;

/// Default cap on the bytes of series whose labels come from requests.
pub const DEFAULT_MAX_SERIES_BYTES: usize = 32 << 20;

/// What one counter costs besides its labels: its key, handle and the exporter's entry.
const COUNTER_OVERHEAD: usize = 256;

/// Counters of one rule series.
const RULE_COUNTERS: usize = 5;

/// The bytes a series of `counters` counters labelled with `label_bytes` is accounted: each
/// counter holds its own copy of the labels, and the exposition writes them again on every
/// scrape; our own map keeps one more.
fn series_bytes(counters: usize, label_bytes: usize) -> usize {
    counters * (2 * label_bytes + COUNTER_OVERHEAD) + label_bytes
}

/// Whose words a stats key is, which decides whose budget its series take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StatsKey<'a> {
    /// A configured rule's key: the rules bound how many there are.
    Rule(&'a str),
    /// Built from a request's values (`detailed_metric`, overrides).
    Request(String),
}

impl StatsKey<'_> {
    pub fn as_str(&self) -> &str {
        match self {
            StatsKey::Rule(key) => key,
            StatsKey::Request(key) => key,
        }
    }
}

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
struct MethodMetrics {
    total_requests: Counter,
    response_time: Histogram,
}

/// Which of `GRPC_METHODS` a call is, for `Metrics::observe`: an index, so that a call in
/// flight holds no handles of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrpcMethod(usize);

/// Connections of one listening port: open now, closed at accept because the port was full,
/// and closed before they were served (no valid TLS handshake or HTTP/2 preface in time).
pub struct ConnectionMetrics {
    pub open: Gauge,
    pub refused: Counter,
    pub handshake_failed: Counter,
    /// Connections closed to make room for a newcomer at the cap.
    pub closed_to_make_room: Counter,
}

pub struct Metrics {
    /// Prometheus, and statsd when exported.
    recorder: Recorders,
    methods: Vec<MethodMetrics>,
    handle: PrometheusHandle,
    near_limit_ratio: f64,
    /// Series of configured rules.
    rules: Mutex<HashMap<String, Arc<RuleCounters>>>,
    /// Series whose labels come from requests, within their own budget.
    requested: Mutex<Requested>,
    budget: SeriesBudget,
    pub config_load_success: Counter,
    pub config_load_error: Counter,
    pub global_shadow_mode: Counter,
    pub invalid_request: Counter,
    backend_errors: Vec<Counter>,
    pub backend_latency: Histogram,
    pub fallback_answers: Counter,
    /// Keys a full memory backend (the embedded one or `local` fallback's) evicted.
    pub memory_evictions: Counter,
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

/// The budget of series whose labels come from requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeriesBudget {
    pub max_series: usize,
    /// As `series_bytes` counts them.
    pub max_bytes: usize,
}

impl Default for SeriesBudget {
    fn default() -> Self {
        SeriesBudget {
            max_series: DEFAULT_MAX_SERIES,
            max_bytes: DEFAULT_MAX_SERIES_BYTES,
        }
    }
}

/// The request-driven series, and what they take of the budget.
#[derive(Default)]
struct Requested {
    rules: HashMap<String, Arc<RuleCounters>>,
    domains_not_found: HashMap<String, Counter>,
    series: usize,
    bytes: usize,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The maps are only inserted into; a panic elsewhere leaves them consistent.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The series for `key` in `series`, made on first use. It is charged to `requested`'s
/// budget; past the budget, new keys share one `_overflow_` series (which the budget holds
/// room for, so it is never refused).
fn capped<T: Clone>(
    requested: &mut Requested,
    series: impl Fn(&mut Requested) -> &mut HashMap<String, T>,
    budget: SeriesBudget,
    key: &str,
    counters: usize,
    make: impl FnOnce(&str) -> T,
) -> T {
    if let Some(found) = series(requested).get(key) {
        return found.clone();
    }
    let bytes = series_bytes(counters, key.len());
    let room = series_bytes(RULE_COUNTERS + 1, OVERFLOW.len());
    let fits =
        requested.series < budget.max_series && requested.bytes + bytes + room <= budget.max_bytes;
    let (key, bytes) = if fits {
        (key, bytes)
    } else {
        (OVERFLOW, series_bytes(counters, OVERFLOW.len()))
    };
    let map = series(requested);
    if let Some(found) = map.get(key) {
        return found.clone();
    }
    let made = make(key);
    map.insert(key.to_owned(), made.clone());
    requested.series += 1;
    requested.bytes += bytes;
    made
}

static METADATA: Metadata<'static> = Metadata::new(module_path!(), metrics::Level::INFO, None);

fn counter(recorder: &dyn Recorder, name: &'static str, labels: Vec<Label>) -> Counter {
    recorder.register_counter(&Key::from_parts(name, labels), &METADATA)
}

impl Metrics {
    /// Metrics whose request-driven series are at most `max_series`, in the default bytes.
    pub fn new(near_limit_ratio: f64, max_series: usize) -> Metrics {
        let budget = SeriesBudget {
            max_series,
            ..SeriesBudget::default()
        };
        Metrics::with_statsd(near_limit_ratio, budget, None)
    }

    /// Metrics that are also exported to statsd through `statsd`.
    pub fn with_statsd(
        near_limit_ratio: f64,
        budget: SeriesBudget,
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
            memory_evictions: plain("turnstile_memory_evictions"),
            local_cache_hits: plain("ratelimit_service_rate_limit_over_limit_with_local_cache"),
            circuit_open: recorder
                .register_gauge(&Key::from_name("turnstile_backend_circuit_open"), &METADATA),
            recorder,
            handle,
            near_limit_ratio,
            rules: Mutex::default(),
            requested: Mutex::default(),
            budget,
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
    pub fn rule(&self, stats_key: &StatsKey<'_>) -> Arc<RuleCounters> {
        match stats_key {
            StatsKey::Rule(key) => {
                let mut rules = lock(&self.rules);
                // Looked up by &str first: an entry() would allocate the key on every call.
                if let Some(found) = rules.get(*key) {
                    return found.clone();
                }
                rules
                    .entry((*key).to_owned())
                    .or_insert_with(|| self.rule_counters(key))
                    .clone()
            }
            StatsKey::Request(key) => capped(
                &mut lock(&self.requested),
                |r| &mut r.rules,
                self.budget,
                key,
                RULE_COUNTERS,
                |key| self.rule_counters(key),
            ),
        }
    }

    /// Series and bytes (as counted) of the request-driven series.
    #[cfg(test)]
    fn requested_series(&self) -> (usize, usize) {
        let requested = lock(&self.requested);
        (requested.series, requested.bytes)
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

    /// The method a call to `path` (`/package.Service/Method`) is counted as.
    pub fn grpc_method(path: &str) -> GrpcMethod {
        // The path's last segment, compared from its end: no scan for the last '/'.
        let is = |method: &str| {
            path.strip_suffix(method)
                .is_some_and(|rest| rest.is_empty() || rest.ends_with('/'))
        };
        GrpcMethod(
            GRPC_METHODS
                .iter()
                .position(|m| is(m))
                .unwrap_or(GRPC_METHODS.len() - 1),
        )
    }

    /// One call of `method`, answered in `elapsed`.
    pub fn observe(&self, method: GrpcMethod, elapsed: Duration) {
        let method = &self.methods[method.0];
        method.total_requests.increment(1);
        method.response_time.record(elapsed.as_secs_f64());
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

    /// The connection series of one listening port (`grpc`, `http`, `debug`, `prometheus`).
    pub fn connections(&self, listener: &'static str) -> ConnectionMetrics {
        let label = || vec![Label::new("listener", listener)];
        ConnectionMetrics {
            open: self.recorder.register_gauge(
                &Key::from_parts("turnstile_connections_open", label()),
                &METADATA,
            ),
            refused: counter(&self.recorder, "turnstile_connections_refused", label()),
            handshake_failed: counter(
                &self.recorder,
                "turnstile_connections_handshake_failed",
                label(),
            ),
            closed_to_make_room: counter(
                &self.recorder,
                "turnstile_connections_closed_to_make_room",
                label(),
            ),
        }
    }

    pub fn set_circuit_open(&self, open: bool) {
        self.circuit_open.set(if open { 1.0 } else { 0.0 });
    }

    pub fn domain_not_found(&self, domain: &str) {
        capped(
            &mut lock(&self.requested),
            |r| &mut r.domains_not_found,
            self.budget,
            domain,
            1,
            |domain| {
                counter(
                    &self.recorder,
                    "ratelimit_service_rate_limit_domain_not_found",
                    vec![Label::new("domain", domain.to_owned())],
                )
            },
        )
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

    /// A call counts as the method its path ends with, whole; any other as "other".
    #[test]
    fn a_call_counts_as_its_paths_last_segment() {
        let rows = [
            (
                "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
                "ShouldRateLimit",
            ),
            ("/grpc.health.v1.Health/Check", "Check"),
            ("/grpc.health.v1.Health/Watch", "Watch"),
            ("ShouldRateLimit", "ShouldRateLimit"),
            ("/a.B/NotShouldRateLimit", "other"),
            ("/a.B/ShouldRateLimit/", "other"),
            (
                "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas",
                "other",
            ),
        ];
        for (path, method) in rows {
            let GrpcMethod(index) = Metrics::grpc_method(path);
            assert_eq!(GRPC_METHODS[index], method, "{path}");
        }
    }

    #[test]
    fn rule_counters_follow_the_reference_arithmetic() {
        let m = Metrics::new(0.8, DEFAULT_MAX_SERIES);
        let rule = m.rule(&StatsKey::Rule("dom.key1_value1.subkey1"));
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
    fn request_driven_series_are_capped_in_number_and_bytes() {
        let series = |text: &str, name: &str| text.lines().filter(|l| l.starts_with(name)).count();
        let m = Metrics::new(0.8, 3);
        for i in 0..50 {
            m.rule(&StatsKey::Request(format!("d.user_{i}")));
            m.domain_not_found(&format!("nope{i}"));
        }
        let text = m.render();
        // Three series in all, and each kind its own overflow series.
        assert_eq!(series(&text, "ratelimit_service_rate_limit_total_hits{"), 3);
        assert_eq!(
            series(&text, "ratelimit_service_rate_limit_domain_not_found{"),
            2
        );
        assert!(text.contains(OVERFLOW));

        // A byte budget: long labels run out of it long before the series cap.
        let budget = SeriesBudget {
            max_series: 10_000,
            max_bytes: 1 << 20,
        };
        let m = Metrics::with_statsd(0.8, budget, None);
        for i in 0..1_000 {
            m.rule(&StatsKey::Request(format!("d.{i}_{}", "v".repeat(4096))));
        }
        let (count, bytes) = m.requested_series();
        assert!(bytes <= budget.max_bytes, "{bytes}");
        assert!(
            bytes > budget.max_bytes * 3 / 4,
            "{bytes}: the budget is used"
        );
        assert!(
            (20..40).contains(&count),
            "{count} series of ~41 KB in 1 MiB"
        );
        assert!(
            m.render().len() < budget.max_bytes,
            "a scrape is bounded too"
        );
    }

    #[test]
    fn configured_rules_keep_their_series_when_requests_used_up_the_budget() {
        let m = Metrics::new(0.8, 10);
        for i in 0..100 {
            m.rule(&StatsKey::Request(format!("d.user_{i}")));
        }
        let o = outcome(true, 4);
        for i in 0..100 {
            let rule = m.rule(&StatsKey::Rule(&format!("d.rule{i}")));
            let hit = RuleHit {
                outcome: &o,
                limit: 5,
                hits: 1,
                shadow: false,
            };
            m.record(&rule, hit);
        }
        let text = m.render();
        for i in 0..100 {
            let line = format!(
                "ratelimit_service_rate_limit_total_hits{{domain=\"d\",key=\"rule{i}\"}} 1"
            );
            assert!(text.contains(&line), "{line} missing");
        }
    }
}
