//! Rule matching cost on a 10 000-rule domain: `DomainRules::lookup` alone, the whole plan
//! step (`CheckRequest::parse` + `Plan::build`, which adds the state key of every hit), and
//! a whole in-process decision on the memory backend (`RateLimiter::check`, no gRPC).
//!
//! The rule set: 4 950 tenants, each with a limit and a nested per-user limit (9 900 rules),
//! plus 100 wildcard rules on `path` (so a wildcard lookup scans up to 100 patterns).
//!
//! `cargo bench --bench matcher` (add `-- --quick` for a shorter run).

use std::fmt::Write as _;
use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use turnstile::backend::memory::MemoryBackend;
use turnstile::config::active::ActiveRules;
use turnstile::config::{self, RuleSet};
use turnstile::ops::metrics::Metrics;
use turnstile::service::fallback::Fallback;
use turnstile::service::plan::Plan;
use turnstile::service::request::{Bounds, CheckRequest};
use turnstile::service::{RateLimiter, Settings};
use turnstile_bench::descriptor;

const TENANTS: usize = 4_950;
const WILDCARDS: usize = 100;

fn rules_yaml() -> String {
    let mut yaml = String::from("domain: bench\ndescriptors:\n");
    for t in 0..TENANTS {
        let _ = write!(
            yaml,
            "  - key: tenant\n    value: t{t}\n    rate_limit: {{unit: minute, requests_per_unit: 1000000}}\n    descriptors:\n      - key: user\n        rate_limit: {{unit: second, requests_per_unit: 1000000, algorithm: token_bucket}}\n"
        );
    }
    for w in 0..WILDCARDS {
        let _ = write!(
            yaml,
            "  - key: path\n    value: /api/v{w}/*\n    rate_limit: {{unit: second, requests_per_unit: 1000000}}\n"
        );
    }
    yaml
}

fn rules() -> RuleSet {
    let rules = config::load_str("bench.yaml", &rules_yaml()).expect("generated rules load");
    let count: usize = rules.domains().map(|d| d.rule_count()).sum();
    assert_eq!(count, 2 * TENANTS + WILDCARDS);
    rules
}

/// A request to the benchmark's domain.
fn request(descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    turnstile_bench::request("bench", descriptors)
}

fn lookup(c: &mut Criterion) {
    let rules = rules();
    let domain = rules.domain("bench").expect("domain bench");
    let mut group = c.benchmark_group("lookup_10k_rules");
    let cases: [(&str, &[(&str, &str)]); 5] = [
        ("exact", &[("tenant", "t4321")]),
        ("nested", &[("tenant", "t4321"), ("user", "alice")]),
        ("wildcard_first", &[("path", "/api/v0/items")]),
        ("wildcard_last", &[("path", "/api/v99/items")]),
        ("miss", &[("path", "/other")]),
    ];
    for (name, entries) in cases {
        assert_eq!(
            domain.lookup(entries.iter().copied()).is_some(),
            name != "miss",
            "{name}"
        );
        group.bench_function(name, |b| {
            b.iter(|| domain.lookup(black_box(entries).iter().copied()))
        });
    }
    group.finish();
}

fn plan(c: &mut Criterion) {
    let rules = rules();
    let bounds = Bounds::default();
    let one = request(vec![descriptor(&[("tenant", "t4321"), ("user", "alice")])]);
    let four = request(vec![
        descriptor(&[("tenant", "t4321")]),
        descriptor(&[("tenant", "t4321"), ("user", "alice")]),
        descriptor(&[("path", "/api/v42/items")]),
        descriptor(&[("tenant", "t17"), ("user", "bob")]),
    ]);
    let mut group = c.benchmark_group("plan_10k_rules");
    for (name, req) in [("1_descriptor", &one), ("4_descriptors", &four)] {
        group.bench_function(name, |b| {
            b.iter(|| {
                let parsed = CheckRequest::parse(black_box(req), &bounds).expect("valid");
                let plan = Plan::build(&rules, &parsed);
                black_box(plan.hits.len())
            })
        });
    }
    group.finish();
}

fn decision(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let limiter = RateLimiter::new(
        Arc::new(ActiveRules::new(rules())),
        MemoryBackend::new(1_000_000, turnstile::backend::memory::DEFAULT_MAX_BYTES),
        Fallback::new(
            1.0,
            1_000,
            turnstile::backend::memory::DEFAULT_MAX_BYTES,
            1_000,
        ),
        Settings::default(),
        Arc::new(Metrics::new(0.8, 10_000)),
    );
    let mut group = c.benchmark_group("check_memory_10k_rules");
    let users: Vec<RateLimitRequest> = (0..1024)
        .map(|u| {
            request(vec![descriptor(&[
                ("tenant", "t4321"),
                ("user", &format!("u{u}")),
            ])])
        })
        .collect();
    let mut i = 0;
    group.bench_function("1_descriptor", |b| {
        b.iter(|| {
            i = (i + 1) % users.len();
            let answer = runtime
                .block_on(limiter.check(&users[i], None, &http::HeaderMap::new()))
                .expect("answer");
            black_box(answer.overall_code)
        })
    });
    group.finish();
}

criterion_group!(benches, lookup, plan, decision);
criterion_main!(benches);
