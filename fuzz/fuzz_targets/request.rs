//! Any bytes as a ShouldRateLimit request, through validation, matching, the memory backend
//! and the answer: refused or answered, never a panic.
#![no_main]

use std::sync::LazyLock;

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use turnstile::backend::memory::{DEFAULT_MAX_BYTES, MemoryBackend};
use turnstile::config::{RuleSet, load_str};
use turnstile::decision::Charging;
use turnstile::service::plan::Plan;
use turnstile::service::request::{Bounds, CheckRequest};
use turnstile::service::response::{self, Headers, MetadataOn, ResponseSettings};

const RULES: &str = "
domain: d
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: w
    value: a*b
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2, algorithm: sliding_window}
  - key: t
    quota_mode: true
    rate_limit: {name: t, unit: hour, requests_per_unit: 5, algorithm: token_bucket, burst: 2}
    descriptors:
      - key: u
        rate_limit: {unlimited: true, replaces: [{name: t}]}
  - key: l
    rate_limit:
      - {unit: second, requests_per_unit: 4, shards: 2}
      - {window: 90s, requests_per_unit: 9, algorithm: sliding_window}
  - key: c
    descriptors:
      - key: r
        rate_limit: {algorithm: concurrency, requests_per_unit: 2, window: 5s}
  - key: s
    value: s*
    share_threshold: true
    metadata: {a: 1}
    rate_limit: {unit: minute, requests_per_unit: 3}
";

static RULE_SET: LazyLock<RuleSet> = LazyLock::new(|| load_str("fuzz.yaml", RULES).unwrap());
static BACKEND: LazyLock<MemoryBackend> =
    LazyLock::new(|| MemoryBackend::new(10_000, DEFAULT_MAX_BYTES));

fuzz_target!(|data: &[u8]| {
    let Ok(request) = RateLimitRequest::decode(data) else {
        return;
    };
    let Ok(checked) = CheckRequest::parse(&request, &Bounds::default()) else {
        return;
    };
    let plan = Plan::build(&RULE_SET, &checked);
    let Ok(outcomes) = BACKEND.evaluate_sync(&plan.hits, Charging::Atomic) else {
        return;
    };
    let settings = ResponseSettings {
        headers: Headers::Ietf,
        metadata: MetadataOn::All,
        reference_metadata: data.first().is_some_and(|b| b & 1 == 1),
        global_shadow: false,
    };
    let built = response::build(&request, &plan, &outcomes, &settings);
    assert_eq!(built.response.statuses.len(), request.descriptors.len());
});
