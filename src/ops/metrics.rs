//! The service's metrics: the reference's stats, and turnstile's own `turnstile_` series.
//!
//! The reference's stats keep its statsd names (`ratelimit.service.rate_limit.<key>.total_hits`)
//! and become Prometheus series through its mapping (`stats`, `mapper`), so dashboards and
//! alerts written for it read the same series here. Stats of configured rules always exist:
//! the rules bound their number. Stats whose keys come from requests (detailed metrics,
//! overrides, unknown domains) have a budget of their own, in keys and in bytes (a key is up
//! to a descriptor's few KiB): past it they fold into one `_overflow_` key per domain, so
//! clients can neither grow memory without bound nor take the series of real rules away; the
//! mapped series are made from these keys, so the budget bounds them too.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, Label, Metadata, Recorder};
use metrics_exporter_prometheus::PrometheusRecorder;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::decision::{BackendError, Outcome};
use crate::ops::mapper::{Mapper, sanitize_stat_name};
use crate::ops::stats::{Stats, Timer};
use crate::ops::statsd::StatsdRecorder;

/// gRPC methods told apart; any other path is "other".
const GRPC_METHODS: [&str; 4] = ["ShouldRateLimit", "Check", "Watch", "other"];

/// How many of `GRPC_METHODS` are unary calls, which the reference counts and times (its
/// stats come from a unary interceptor; streams have none).
const UNARY_METHODS: usize = 2;

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

/// Counters of one rule's stats key.
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
    response_time: Timer,
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
    /// turnstile's own series.
    recorder: PrometheusRecorder,
    /// The reference's stats, mapped to series (and sent to statsd when exported).
    stats: Stats,
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
    /// The reference's one count of failed backend calls.
    backend_error: Counter,
    /// Failed backend calls by kind.
    backend_errors: Vec<Counter>,
    pub backend_latency: Histogram,
    pub fallback_answers: Counter,
    /// Keys a full memory backend (the embedded one or `local` fallback's) evicted.
    pub memory_evictions: Counter,
    pub local_cache_hits: Counter,
    /// What becomes of the charges `local` mode owes the backend.
    pub ledger: LedgerCounters,
    circuit_open: Gauge,
}

/// What becomes of the charges `local` mode owes the backend (see `ledger`).
#[derive(Clone)]
pub struct LedgerCounters {
    /// Units charged to the backend.
    pub carried: Counter,
    /// Units dropped because their window had ended before the backend answered again.
    pub dropped: Counter,
    /// Requests refused because the ledger had no room for their charges.
    pub refused: Counter,
}

impl Default for LedgerCounters {
    fn default() -> LedgerCounters {
        LedgerCounters {
            carried: Counter::noop(),
            dropped: Counter::noop(),
            refused: Counter::noop(),
        }
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
/// budget; past the budget, new keys share the `overflow` key (which the budget holds room
/// for, so it is never refused).
fn capped<T: Clone>(
    requested: &mut Requested,
    series: impl Fn(&mut Requested) -> &mut HashMap<String, T>,
    budget: SeriesBudget,
    (key, overflow): (&str, &str),
    counters: usize,
    make: impl FnOnce(&str) -> T,
) -> T {
    if let Some(found) = series(requested).get(key) {
        return found.clone();
    }
    let bytes = series_bytes(counters, key.len());
    let room = series_bytes(RULE_COUNTERS + 1, overflow.len());
    let fits =
        requested.series < budget.max_series && requested.bytes + bytes + room <= budget.max_bytes;
    let (key, bytes) = if fits {
        (key, bytes)
    } else {
        (overflow, series_bytes(counters, overflow.len()))
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
    /// Metrics whose request-driven series are at most `max_series`, in the default bytes,
    /// with the reference's default mapping.
    pub fn new(near_limit_ratio: f64, max_series: usize) -> Metrics {
        let budget = SeriesBudget {
            max_series,
            ..SeriesBudget::default()
        };
        Metrics::with_mapping(
            near_limit_ratio,
            budget,
            Mapper::reference_default(false),
            None,
        )
    }

    /// Metrics whose reference stats become series through `mapper`, and are also exported
    /// to statsd through `statsd`.
    pub fn with_mapping(
        near_limit_ratio: f64,
        budget: SeriesBudget,
        mapper: Mapper,
        statsd: Option<StatsdRecorder>,
    ) -> Metrics {
        let recorder = PrometheusBuilder::new()
            .set_buckets(&LATENCY_BUCKETS)
            .expect("static, non-empty buckets")
            .build_recorder();
        let handle = recorder.handle();
        let stats = Stats::new(mapper, statsd);
        let plain = |name| counter(&recorder, name, Vec::new());
        let methods = GRPC_METHODS[..UNARY_METHODS]
            .iter()
            .map(|method| MethodMetrics {
                total_requests: stats.counter(&format!("ratelimit_server.{method}.total_requests")),
                response_time: stats.timer(&format!("ratelimit_server.{method}.response_time")),
            })
            .collect();
        let service = |name: &str| stats.counter(&format!("ratelimit.service.{name}"));
        Metrics {
            methods,
            config_load_success: service("config_load_success"),
            config_load_error: service("config_load_error"),
            global_shadow_mode: service("global_shadow_mode"),
            invalid_request: service("call.should_rate_limit.service_error"),
            backend_error: service("call.should_rate_limit.redis_error"),
            backend_errors: BackendError::KINDS
                .iter()
                .map(|&kind| {
                    counter(
                        &recorder,
                        "turnstile_backend_errors",
                        vec![Label::new("kind", kind)],
                    )
                })
                .collect(),
            backend_latency: recorder.register_histogram(
                &Key::from_name("turnstile_backend_latency_seconds"),
                &METADATA,
            ),
            fallback_answers: plain("turnstile_backend_fallback_answers"),
            memory_evictions: plain("turnstile_memory_evictions"),
            local_cache_hits: plain("turnstile_local_cache_hits"),
            ledger: LedgerCounters {
                carried: plain("turnstile_local_units_carried"),
                dropped: plain("turnstile_local_units_dropped"),
                refused: plain("turnstile_local_ledger_full_refusals"),
            },
            circuit_open: recorder
                .register_gauge(&Key::from_name("turnstile_backend_circuit_open"), &METADATA),
            recorder,
            stats,
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

    /// The Prometheus text exposition: the reference's series, the process's, then
    /// turnstile's own.
    pub fn render(&self) -> String {
        let mut text = String::new();
        self.stats.render(&mut text);
        crate::ops::process::render(&mut text);
        text.push_str(&self.handle.render());
        text
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
            StatsKey::Request(key) => {
                let domain = key.split_once('.').map_or(key.as_str(), |(d, _)| d);
                capped(
                    &mut lock(&self.requested),
                    |r| &mut r.rules,
                    self.budget,
                    (key, &format!("{domain}.{OVERFLOW}")),
                    RULE_COUNTERS,
                    |key| self.rule_counters(key),
                )
            }
        }
    }

    /// Series and bytes (as counted) of the request-driven series.
    #[cfg(test)]
    fn requested_series(&self) -> (usize, usize) {
        let requested = lock(&self.requested);
        (requested.series, requested.bytes)
    }

    fn rule_counters(&self, stats_key: &str) -> Arc<RuleCounters> {
        let key = sanitize_stat_name(stats_key);
        let make = |stat: &str| {
            self.stats
                .counter(&format!("ratelimit.service.rate_limit.{key}.{stat}"))
        };
        Arc::new(RuleCounters {
            total_hits: make("total_hits"),
            over_limit: make("over_limit"),
            near_limit: make("near_limit"),
            within_limit: make("within_limit"),
            shadow_mode: make("shadow_mode"),
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

    /// Count a failed backend call, by its kind too.
    pub fn backend_error(&self, error: &BackendError) {
        self.backend_error.increment(1);
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
        if let Some(method) = self.methods.get(method.0) {
            method.total_requests.increment(1);
            method.response_time.observe(elapsed);
        }
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
            (domain, OVERFLOW),
            1,
            |domain| {
                let domain = sanitize_stat_name(domain);
                self.stats.counter(&format!(
                    "ratelimit.service.rate_limit.{domain}.domain_not_found"
                ))
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

    /// Envoy Gateway's mapping file for its rate-limit deployment: the reference's default
    /// mapping with the response time left in milliseconds (no `scale`).
    fn envoy_gateway_mapper() -> Mapper {
        Mapper::from_yaml(&crate::ops::mapper::REFERENCE_DEFAULT.replacen(
            ", scale: 0.001}",
            "}",
            1,
        ))
        .unwrap()
    }

    /// A custom file: a drop, a regex with its own labels, everything else unmatched.
    const CUSTOM: &str = r#"
mappings:
- match: ratelimit.service.rate_limit.*.*.within_limit
  action: drop
  name: dropped
- match: 'ratelimit\.service\.rate_limit\.([^.]+)\.(.+)\.total_hits'
  match_type: regex
  name: rl_hits
  labels: {domain: $1, path: $2}
"#;

    /// The reference's series (sample lines) after one admitted hit on `stats_key`.
    fn series_after_one_hit(mapper: Mapper, stats_key: &str) -> String {
        let m = Metrics::with_mapping(0.8, SeriesBudget::default(), mapper, None);
        let rule = m.rule(&StatsKey::Rule(stats_key));
        let o = outcome(true, 9);
        let hit = RuleHit {
            outcome: &o,
            limit: 10,
            hits: 1,
            shadow: false,
        };
        m.record(&rule, hit);
        let mut text = String::new();
        m.stats.render(&mut text);
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| format!("{l}\n"))
            .collect()
    }

    /// A mapping file's label, the file, a stats key, and the series text it makes.
    type Row = (&'static str, fn() -> Mapper, &'static str, &'static str);

    #[test]
    fn descriptor_paths_become_the_series_each_mapping_file_makes() {
        let default = || Mapper::reference_default(false);
        let custom = || Mapper::from_yaml(CUSTOM).unwrap();
        let rows: [Row; 10] = [
            (
                "default",
                default,
                "edge.plan_free",
                concat!(
                    "ratelimit_service_rate_limit_total_hits{domain=\"edge\",key1=\"plan_free\"} 1\n",
                    "ratelimit_service_rate_limit_within_limit{domain=\"edge\",key1=\"plan_free\"} 1\n",
                ),
            ),
            (
                "default",
                default,
                "edge.plan_free.user",
                concat!(
                    "ratelimit_service_rate_limit_total_hits{domain=\"edge\",key1=\"plan_free\",key2=\"user\"} 1\n",
                    "ratelimit_service_rate_limit_within_limit{domain=\"edge\",key1=\"plan_free\",key2=\"user\"} 1\n",
                ),
            ),
            (
                "default",
                default,
                "edge.a_1.b.c_3",
                concat!(
                    "ratelimit_service_rate_limit_total_hits{domain=\"edge\",key1=\"a_1\",key2=\"b\"} 1\n",
                    "ratelimit_service_rate_limit_within_limit{domain=\"edge\",key1=\"a_1\",key2=\"b\"} 1\n",
                ),
            ),
            // An address's dots do not make levels; `:` becomes `_`.
            (
                "default",
                default,
                "edge.remote_address_10.0.0.1",
                concat!(
                    "ratelimit_service_rate_limit_total_hits{domain=\"edge\",key1=\"remote_address_10_0_0_1\"} 1\n",
                    "ratelimit_service_rate_limit_within_limit{domain=\"edge\",key1=\"remote_address_10_0_0_1\"} 1\n",
                ),
            ),
            (
                "default",
                default,
                "edge.path_/a:b",
                concat!(
                    "ratelimit_service_rate_limit_total_hits{domain=\"edge\",key1=\"path_/a_b\"} 1\n",
                    "ratelimit_service_rate_limit_within_limit{domain=\"edge\",key1=\"path_/a_b\"} 1\n",
                ),
            ),
            // Envoy Gateway's keys: route paths with slashes, two levels.
            (
                "envoy gateway",
                envoy_gateway_mapper,
                "default/eg/http.httproute/default/r/rule/0/match/0_x.rule-0-match-0_rule-0-match-0",
                concat!(
                    "ratelimit_service_rate_limit_total_hits{domain=\"default/eg/http\",key1=\"httproute/default/r/rule/0/match/0_x\",key2=\"rule-0-match-0_rule-0-match-0\"} 1\n",
                    "ratelimit_service_rate_limit_within_limit{domain=\"default/eg/http\",key1=\"httproute/default/r/rule/0/match/0_x\",key2=\"rule-0-match-0_rule-0-match-0\"} 1\n",
                ),
            ),
            (
                "envoy gateway",
                envoy_gateway_mapper,
                "edge.plan_free",
                concat!(
                    "ratelimit_service_rate_limit_total_hits{domain=\"edge\",key1=\"plan_free\"} 1\n",
                    "ratelimit_service_rate_limit_within_limit{domain=\"edge\",key1=\"plan_free\"} 1\n",
                ),
            ),
            (
                "custom",
                custom,
                "edge.plan_free",
                "rl_hits{domain=\"edge\",path=\"plan_free\"} 1\n",
            ),
            (
                "custom",
                custom,
                "edge.plan_free.user",
                concat!(
                    "ratelimit_service_rate_limit_edge_plan_free_user_within_limit 1\n",
                    "rl_hits{domain=\"edge\",path=\"plan_free.user\"} 1\n",
                ),
            ),
            (
                "custom",
                custom,
                "my-edge.k",
                "rl_hits{domain=\"my-edge\",path=\"k\"} 1\n",
            ),
        ];
        for (file, mapper, key, series) in rows {
            assert_eq!(series_after_one_hit(mapper(), key), series, "{file}: {key}");
        }
    }

    #[test]
    fn response_time_is_a_histogram_in_seconds_or_in_milliseconds() {
        let rows = [
            (Mapper::reference_default(false), "0.025", "0.007"),
            (envoy_gateway_mapper(), "10", "7"),
        ];
        for (mapper, le, sum) in rows {
            let m = Metrics::with_mapping(0.8, SeriesBudget::default(), mapper, None);
            let method = Metrics::grpc_method(
                "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            );
            m.observe(method, Duration::from_millis(7));
            m.observe(
                Metrics::grpc_method("/grpc.health.v1.Health/Watch"),
                Duration::from_millis(7),
            );
            let text = m.render();
            let labels = "grpc_method=\"ShouldRateLimit\"";
            for line in [
                format!("ratelimit_service_response_time_seconds_bucket{{{labels},le=\"{le}\"}} 1"),
                format!("ratelimit_service_response_time_seconds_sum{{{labels}}} {sum}"),
                format!("ratelimit_service_response_time_seconds_count{{{labels}}} 1"),
                format!("ratelimit_service_total_requests{{{labels}}} 1"),
                "# TYPE ratelimit_service_response_time_seconds histogram".to_owned(),
            ] {
                assert!(text.contains(&line), "{line} missing in\n{text}");
            }
            assert!(
                !text.contains("Watch"),
                "streams are not the reference's calls"
            );
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
            let prefix = format!("{name}{{domain=\"dom\",key1=\"key1_value1\",key2=\"subkey1\"}} ");
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
            let rule = m.rule(&StatsKey::Request(format!("d.user_{i}")));
            rule.total_hits.increment(1);
            m.domain_not_found(&format!("nope{i}"));
        }
        let text = m.render();
        // Three keys in all, and each kind its own overflow key: rules keep their domain.
        assert_eq!(series(&text, "ratelimit_service_rate_limit_total_hits{"), 3);
        assert!(text.contains(
            "ratelimit_service_rate_limit_total_hits{domain=\"d\",key1=\"_overflow_\"} 48"
        ));
        // The reference names an unknown domain's stat after the domain; no mapping takes it.
        assert_eq!(series(&text, "ratelimit_service_rate_limit_nope"), 1);
        assert_eq!(
            series(
                &text,
                "ratelimit_service_rate_limit__overflow__domain_not_found 49"
            ),
            1
        );

        // A byte budget: long labels run out of it long before the series cap.
        let budget = SeriesBudget {
            max_series: 10_000,
            max_bytes: 1 << 20,
        };
        let m = Metrics::with_mapping(0.8, budget, Mapper::reference_default(false), None);
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
                "ratelimit_service_rate_limit_total_hits{{domain=\"d\",key1=\"rule{i}\"}} 1"
            );
            assert!(text.contains(&line), "{line} missing");
        }
    }
}
