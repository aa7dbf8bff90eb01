//! The service end to end on the embedded memory backend (one connection test holds calls
//! at a frozen Redis): the real binary, over gRPC and HTTP, with rules in the reference's
//! format.

mod support;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::google::protobuf::UInt64Value;
use support::clock::{CALLS_SPAN, HOUR, MINUTE, clear_of_end};
use support::raw::{RawBody, framed, raw_call, raw_connection};
use support::turnstile::{Rules, Turnstile, descriptor, nested_rules, request, signal};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const RULES: &str = r#"
domain: test
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit: {unit: second, requests_per_unit: 5}
  - key: minute
    rate_limit: {name: per-minute, unit: minute, requests_per_unit: 3}
  - key: wide
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: narrow
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: unlimited
    rate_limit: {unlimited: true}
  - key: a
    rate_limit: {name: a-rule, unit: hour, requests_per_unit: 5}
  - key: b
    rate_limit: {unit: hour, requests_per_unit: 10, replaces: [{name: a-rule}]}
  - key: bucket
    rate_limit: {unit: second, requests_per_unit: 1, algorithm: token_bucket, burst: 2}
  - key: sliding
    rate_limit: {unit: minute, requests_per_unit: 2, algorithm: sliding_window}
  - key: layered
    rate_limit:
      - {name: layered, unit: hour, requests_per_unit: 5}
      - {unit: minute, requests_per_unit: 2, algorithm: token_bucket}
  - key: short
    rate_limit: {window: 2s, requests_per_unit: 1, algorithm: sliding_window}
"#;

async fn start(extra: &[&str]) -> (Rules, Turnstile) {
    let rules = Rules::new(RULES);
    let turnstile = Turnstile::start(rules.path(), extra).await;
    (rules, turnstile)
}

fn code(response: &RateLimitResponse) -> Code {
    Code::try_from(response.overall_code).unwrap()
}

/// An error and every error under it, as one line: what a refusal's cause is matched on.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

fn codes(response: &RateLimitResponse) -> Vec<Code> {
    response
        .statuses
        .iter()
        .map(|s| Code::try_from(s.code).unwrap())
        .collect()
}

fn remaining(response: &RateLimitResponse) -> Vec<u32> {
    response
        .statuses
        .iter()
        .map(|s| s.limit_remaining)
        .collect()
}

fn reset(status: &DescriptorStatus) -> Duration {
    let d = status
        .duration_until_reset
        .as_ref()
        .expect("duration_until_reset");
    Duration::new(d.seconds as u64, d.nanos as u32)
}

#[tokio::test]
async fn counts_down_then_refuses_with_exact_remaining_and_reset() {
    let (_rules, t) = start(&[]).await;
    clear_of_end(MINUTE, CALLS_SPAN).await;
    let one = || request("test", vec![descriptor(&[("minute", "x")])]);
    for expected in [2, 1, 0] {
        let r = t.call(one()).await.unwrap();
        assert_eq!(code(&r), Code::Ok);
        assert_eq!(remaining(&r), [expected]);
    }
    let over = t.call(one()).await.unwrap();
    assert_eq!(code(&over), Code::OverLimit);
    assert_eq!(codes(&over), [Code::OverLimit]);
    let status = &over.statuses[0];
    let limit = status.current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.name.as_str(), limit.requests_per_unit, limit.unit),
        ("per-minute", 3, Unit::Minute as i32)
    );
    assert_eq!(status.limit_remaining, 0);
    let until = reset(status);
    assert!(
        until > Duration::ZERO && until <= Duration::from_secs(60),
        "{until:?}"
    );
}

#[tokio::test]
async fn statuses_follow_request_order_and_unmatched_descriptors_have_no_limit() {
    let (_rules, t) = start(&[]).await;
    let r = t
        .call(request(
            "test",
            vec![
                descriptor(&[("nobody", "x")]),
                descriptor(&[("key1", "value1")]),
                descriptor(&[("key1", "value1"), ("subkey1", "anything")]),
                descriptor(&[("unlimited", "x")]),
                descriptor(&[("key1", "value1"), ("subkey1", "a"), ("deeper", "b")]),
            ],
        ))
        .await
        .unwrap();
    assert_eq!(code(&r), Code::Ok);
    assert_eq!(codes(&r), [Code::Ok; 5]);
    let limited: Vec<bool> = r
        .statuses
        .iter()
        .map(|s| s.current_limit.is_some())
        .collect();
    assert_eq!(limited, [false, false, true, false, false]);
    assert_eq!(remaining(&r), [0, 0, 4, u32::MAX, 0]);
    assert!(r.statuses[0].duration_until_reset.is_none());
}

#[tokio::test]
async fn unknown_domain_answers_ok_without_limits() {
    let (_rules, t) = start(&[]).await;
    let r = t
        .call(request("elsewhere", vec![descriptor(&[("minute", "x")])]))
        .await
        .unwrap();
    assert_eq!(code(&r), Code::Ok);
    assert!(r.statuses[0].current_limit.is_none());
    let (_, metrics) = t.http_get("/metrics").await.unwrap();
    assert!(
        metrics.contains("ratelimit_service_rate_limit_elsewhere_domain_not_found 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_refused_request_consumes_nothing_on_its_other_descriptors() {
    for (charging, wide_left) in [("atomic", 8), ("per-descriptor", 7)] {
        let (_rules, t) = start(&["--charging", charging]).await;
        let both = || {
            request(
                "test",
                vec![descriptor(&[("wide", "w")]), descriptor(&[("narrow", "n")])],
            )
        };
        assert_eq!(code(&t.call(both()).await.unwrap()), Code::Ok);
        let refused = t.call(both()).await.unwrap();
        assert_eq!(code(&refused), Code::OverLimit);
        assert_eq!(codes(&refused), [Code::Ok, Code::OverLimit]);
        let alone = t
            .call(request("test", vec![descriptor(&[("wide", "w")])]))
            .await
            .unwrap();
        assert_eq!(remaining(&alone), [wide_left], "charging {charging}");
    }
}

#[tokio::test]
async fn the_reference_answers_where_clients_see_them() {
    let rules = Rules::new(support::reference::RULES);
    let t = Turnstile::start(rules.path(), &[]).await;
    support::reference::check(&t, false).await;
}

#[tokio::test]
async fn shadow_mode_counts_but_never_refuses() {
    let (_rules, t) = start(&[]).await;
    let one = || request("test", vec![descriptor(&[("shadow", "s")])]);
    assert_eq!(remaining(&t.call(one()).await.unwrap()), [0]);
    let over = t.call(one()).await.unwrap();
    assert_eq!(code(&over), Code::Ok);
    assert_eq!(codes(&over), [Code::Ok]);
    assert!(over.statuses[0].current_limit.is_some());
    let (_, metrics) = t.http_get("/metrics").await.unwrap();
    assert!(
        metrics.contains(
            "ratelimit_service_rate_limit_shadow_mode{domain=\"test\",key1=\"shadow\"} 1"
        ),
        "{metrics}"
    );
}

#[tokio::test]
async fn hits_addend_at_request_and_descriptor_level() {
    let (_rules, t) = start(&[]).await;
    clear_of_end(MINUTE, CALLS_SPAN).await;
    let mut two = request("test", vec![descriptor(&[("minute", "m")])]);
    two.hits_addend = 2;
    assert_eq!(remaining(&t.call(two).await.unwrap()), [1]);

    let mut read = request("test", vec![descriptor(&[("minute", "m")])]);
    read.hits_addend = 9;
    read.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    let r = t.call(read.clone()).await.unwrap();
    assert_eq!(
        (code(&r), remaining(&r)),
        (Code::Ok, vec![1]),
        "0 reads only"
    );
    assert_eq!(remaining(&t.call(read).await.unwrap()), [1]);

    let mut big = request("test", vec![descriptor(&[("minute", "m")])]);
    big.descriptors[0].hits_addend = Some(UInt64Value { value: u64::MAX });
    assert_eq!(code(&t.call(big).await.unwrap()), Code::OverLimit);
}

#[tokio::test]
async fn a_request_override_replaces_the_limit_and_counts_separately() {
    let (_rules, t) = start(&[]).await;
    let mut overridden = request("test", vec![descriptor(&[("minute", "o")])]);
    overridden.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 10,
        unit: Unit::Hour as i32,
    });
    let r = t.call(overridden).await.unwrap();
    assert_eq!(remaining(&r), [9]);
    let limit = r.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.requests_per_unit, limit.unit),
        (10, Unit::Hour as i32)
    );
    let plain = t
        .call(request("test", vec![descriptor(&[("minute", "o")])]))
        .await
        .unwrap();
    assert_eq!(
        remaining(&plain),
        [2],
        "the configured limit has its own counter"
    );

    // Overrides Envoy passes on from dynamic metadata get answers, never errors (an error
    // lets the request through): 0 per unit blocks, as in the reference; an UNKNOWN unit names
    // no window, so the configured rule (1 per hour) decides.
    for (requests_per_unit, unit, expected, left, decided_by) in [
        (0, Unit::Second, Code::OverLimit, 0, 0),
        (0, Unit::Day, Code::OverLimit, 0, 0),
        (7, Unit::Unknown, Code::Ok, 0, 1),
        (7, Unit::Unknown, Code::OverLimit, 0, 1),
    ] {
        let mut r = request("test", vec![descriptor(&[("narrow", "o")])]);
        r.descriptors[0].limit = Some(RateLimitOverride {
            requests_per_unit,
            unit: unit as i32,
        });
        let answer = t.call(r).await.unwrap();
        assert_eq!(code(&answer), expected, "{requests_per_unit}/{unit:?}");
        assert_eq!(remaining(&answer), [left]);
        // Which limit decided shows in its figure (the override's 0, the rule's 1); its
        // name is the YAML `name`, empty here for both, as the reference answers.
        let limit = answer.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.name.as_str()),
            (decided_by, "")
        );
    }
}

#[tokio::test]
async fn replaces_drops_the_replaced_rule() {
    let (_rules, t) = start(&[]).await;
    let r = t
        .call(request(
            "test",
            vec![descriptor(&[("a", "1")]), descriptor(&[("b", "1")])],
        ))
        .await
        .unwrap();
    assert!(
        r.statuses[0].current_limit.is_none(),
        "a-rule is replaced by b"
    );
    assert_eq!(remaining(&r), [0, 9]);
    let alone = t
        .call(request("test", vec![descriptor(&[("a", "1")])]))
        .await
        .unwrap();
    assert_eq!(remaining(&alone), [4], "the replaced rule was not counted");
}

#[tokio::test]
async fn token_bucket_and_sliding_window_answer_with_exact_retry_times() {
    use envoy_types::pb::google::protobuf::value::Kind;
    let (_rules, t) = start(&[]).await;
    let bucket = || request("test", vec![descriptor(&[("bucket", "b")])]);
    assert_eq!(remaining(&t.call(bucket()).await.unwrap()), [1]);
    assert_eq!(remaining(&t.call(bucket()).await.unwrap()), [0]);
    let over = t.call(bucket()).await.unwrap();
    assert_eq!(code(&over), Code::OverLimit);
    // Envoy shows whole seconds: a refusal's status says 1 s, its metadata the exact time.
    assert_eq!(reset(&over.statuses[0]), Duration::from_secs(1));
    let metadata = over.dynamic_metadata.as_ref().expect("dynamic_metadata");
    let Some(Kind::NumberValue(retry_ms)) = metadata.fields["reset_ms"].kind else {
        panic!("reset_ms: {metadata:?}");
    };
    assert!(retry_ms > 500.0 && retry_ms < 1_000.0, "{retry_ms}");

    let sliding = || request("test", vec![descriptor(&[("sliding", "s")])]);
    assert_eq!(remaining(&t.call(sliding()).await.unwrap()), [1]);
    assert_eq!(remaining(&t.call(sliding()).await.unwrap()), [0]);
    let over = t.call(sliding()).await.unwrap();
    assert_eq!(code(&over), Code::OverLimit);
    let retry = reset(&over.statuses[0]);
    assert!(
        retry > Duration::from_secs(50) && retry <= Duration::from_secs(60),
        "{retry:?}"
    );
}

#[tokio::test]
async fn malformed_requests_get_invalid_argument_and_count_nothing() {
    let (_rules, t) = start(&[]).await;
    let good = || descriptor(&[("minute", "bad-input")]);
    let mut cases = vec![
        (
            request("", vec![good()]),
            "rate limit domain must not be empty",
        ),
        (
            request("test", vec![]),
            "rate limit descriptor list must not be empty",
        ),
        (
            request("test", vec![good(), descriptor(&[])]),
            "descriptor 1: has no entries",
        ),
        (
            request("test", vec![good(), descriptor(&[("", "v")])]),
            "descriptor 1: entry 0 has an empty key",
        ),
        (
            request(
                "test",
                vec![good(), descriptor(&[("k", &"v".repeat(5000))])],
            ),
            "descriptor 1: keys and values together is 5001 bytes; the maximum is 4096",
        ),
        (
            request("test", vec![good(); 65]),
            "65 descriptors; the maximum is 64",
        ),
    ];
    let mut bad_unit = request("test", vec![good()]);
    bad_unit.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: 99,
    });
    cases.push((
        bad_unit,
        "descriptor 0: limit override has an invalid unit (99)",
    ));
    for (bad, message) in cases {
        let status = t.call(bad).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert_eq!(status.message(), message);
    }
    let after = t.call(request("test", vec![good()])).await.unwrap();
    assert_eq!(remaining(&after), [2], "no malformed request was counted");
}

#[tokio::test]
async fn http_endpoints_answer_as_the_reference() {
    let (_rules, t) = start(&[]).await;
    assert_eq!(
        t.http_get("/healthcheck").await.unwrap(),
        (200, "OK".into())
    );
    let body = r#"{"domain":"test","descriptors":[{"entries":[{"key":"narrow","value":"j"}]}]}"#;
    let (status, ok) = t.http_post("/json", body).await.unwrap();
    assert_eq!(status, 200, "{ok}");
    assert!(ok.contains(r#""overallCode":"OK""#), "{ok}");
    let (status, over) = t.http_post("/json", body).await.unwrap();
    assert_eq!(status, 429, "{over}");
    assert!(over.contains(r#""code":"OVER_LIMIT""#), "{over}");
    let (status, bad) = t.http_post("/json", "{not json").await.unwrap();
    assert_eq!(status, 400, "{bad}");
    let (status, empty) = t.http_post("/json", r#"{"domain":"test"}"#).await.unwrap();
    assert_eq!(
        (status, empty.as_str()),
        (400, "rate limit descriptor list must not be empty")
    );

    let (status, rlconfig) = t.http_get("/rlconfig").await.unwrap();
    assert_eq!(status, 200);
    assert!(rlconfig.starts_with("# version "), "{rlconfig}");
    assert!(
        rlconfig.contains("test.minute: unit=MINUTE requests_per_unit=3, shadow_mode: false"),
        "{rlconfig}"
    );
    let (_, metrics) = t.http_get("/metrics").await.unwrap();
    for line in [
        "ratelimit_service_rate_limit_total_hits{domain=\"test\",key1=\"narrow\"} 2",
        "ratelimit_service_rate_limit_over_limit{domain=\"test\",key1=\"narrow\"} 1",
        "ratelimit_service_rate_limit_within_limit{domain=\"test\",key1=\"narrow\"} 1",
        "ratelimit_service_config_load_success 1",
    ] {
        assert!(metrics.contains(line), "{line} missing in\n{metrics}");
    }
}

/// A failed backend is the service's fault, not the request's: `/json` answers 503 (400 is
/// for bad requests).
#[tokio::test]
async fn json_answers_503_when_the_backend_fails() {
    let mut redis = support::redis::RedisServer::start();
    let rules = Rules::new(RULES);
    let url = redis.url();
    let args = ["--backend", "redis", "--redis-url", &url];
    let t = Turnstile::start(
        rules.path(),
        &[&args[..], &["--on-backend-error", "error"]].concat(),
    )
    .await;
    let body = r#"{"domain":"test","descriptors":[{"entries":[{"key":"wide","value":"j"}]}]}"#;
    // Redis is connected in the background: wait for a first answer from it.
    let start = std::time::Instant::now();
    loop {
        let (status, message) = t.http_post("/json", body).await.unwrap();
        if status == 200 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{status} {message}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    redis.stop();
    let (status, message) = t.http_post("/json", body).await.unwrap();
    assert_eq!(status, 503, "{message}");
    assert!(message.contains("backend"), "{message}");
    let (status, _) = t.http_post("/json", r#"{"domain":""}"#).await.unwrap();
    assert_eq!(
        status, 400,
        "a bad request stays one while the backend is down"
    );
}

/// Resident memory of a process, from /proc.
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kib * 1024
}

/// A flood of the largest descriptors a client may send, every one new and under a year-long
/// override (a backend key and a request-driven series each): memory stays within the
/// configured bytes, every call is still decided (the full memory backend evicts), and
/// other clients' new keys on a configured rule, used between flood calls, are limited on
/// their counts and keep their rule's series.
#[tokio::test]
async fn request_driven_memory_stays_within_its_byte_bounds() {
    const SERIES_BYTES: u64 = 4 << 20;
    const MEMORY_BYTES: u64 = 8 << 20;
    const CALLS: usize = 200;
    const DESCRIPTORS: usize = 64;
    const FILLERS: usize = 3_000;
    const VICTIMS: usize = 32;
    let rules = Rules::new(RULES);
    let (series, memory) = (SERIES_BYTES.to_string(), MEMORY_BYTES.to_string());
    let args = ["--max-series-bytes", &series, "--memory-max-bytes", &memory];
    let t = Turnstile::start(rules.path(), &args).await;
    t.call(request("test", vec![descriptor(&[("wide", "warm-up")])]))
        .await
        .unwrap();
    let before = rss_bytes(t.pid());
    let mut client = t.client().await;
    let year_long = |value: &str| {
        let mut d = descriptor(&[("k", value)]);
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 10,
            unit: Unit::Year as i32,
        });
        d
    };
    // 64 descriptors of 4 095 bytes: 256 KiB per call, 51 MiB in all.
    let flood = |call: usize| {
        let descriptors = (0..DESCRIPTORS)
            .map(|i| year_long(&format!("{call}-{i}-{}", "v".repeat(4096))[..4095]))
            .collect();
        request("test", descriptors)
    };
    // Short keys, one a call, to fill the room long ones leave.
    let filler = |n: usize| request("test", vec![year_long(&format!("s{n}"))]);
    let victim = |v: usize| {
        let tenant = format!("tenant-{v:04}.example.com");
        request("test", vec![descriptor(&[("narrow", &tenant)])])
    };
    // Answers by their code, or the error's: the flood's, and the victims' in each round.
    type Answer = Result<tonic::Response<RateLimitResponse>, tonic::Status>;
    let tally = |tally: &mut BTreeMap<String, usize>, answer: Answer| {
        let answer = answer.map(|r| code(r.get_ref())).map_err(|e| e.code());
        *tally.entry(format!("{answer:?}")).or_insert(0) += 1;
    };
    let mut flood_answers = BTreeMap::new();
    let mut rounds = Vec::new();
    for call in 0..CALLS {
        let answer = client.should_rate_limit(flood(call)).await;
        tally(&mut flood_answers, answer);
    }
    for n in 0..FILLERS {
        tally(
            &mut flood_answers,
            client.should_rate_limit(filler(n)).await,
        );
    }
    // The victims' keys are created once the backend is full, then used between floods.
    for round in 0..3 {
        let answer = client.should_rate_limit(flood(CALLS + round)).await;
        tally(&mut flood_answers, answer);
        let mut answers = BTreeMap::new();
        for v in 0..VICTIMS {
            tally(&mut answers, client.should_rate_limit(victim(v)).await);
        }
        rounds.push(answers);
    }
    let after = rss_bytes(t.pid());
    let (_, metrics) = t.http_get("/metrics").await.unwrap();
    let evictions = t.metric("turnstile_memory_evictions").await.unwrap_or(0.0) as u64;
    println!(
        "RSS {} MiB -> {} MiB over {CALLS} calls of 256 KiB and {FILLERS} short ones, {evictions} keys evicted; flood \
         answers {flood_answers:?}; the {VICTIMS} victims' rounds {rounds:?}; a scrape is {} KiB",
        before >> 20,
        after >> 20,
        metrics.len() >> 10
    );
    let all = |code: Code| BTreeMap::from([(format!("{:?}", Ok::<_, ()>(code)), VICTIMS)]);
    assert_eq!(
        flood_answers,
        BTreeMap::from([(format!("{:?}", Ok::<_, ()>(Code::Ok)), CALLS + FILLERS + 3)]),
        "new keys are admitted"
    );
    assert_eq!(
        rounds,
        [all(Code::Ok), all(Code::OverLimit), all(Code::OverLimit)],
        "1 per hour, enforced for every victim"
    );
    // A flood key takes more than 4 KiB: at most MEMORY_BYTES / 4 KiB of them fit.
    let flooded = (CALLS * DESCRIPTORS) as u64;
    assert!(
        evictions >= flooded - MEMORY_BYTES / 4096,
        "{evictions} of {flooded} evicted"
    );
    // The caps account keys and labels with their copies, not the allocator's slack and
    // the buffers of requests in flight: allow twice the caps and a margin.
    let bound = 2 * (SERIES_BYTES + MEMORY_BYTES) + (16 << 20);
    assert!(
        after.saturating_sub(before) < bound,
        "RSS grew by {} MiB",
        (after - before) >> 20
    );
    assert!(
        (metrics.len() as u64) < SERIES_BYTES,
        "a scrape is bounded too"
    );
    assert!(metrics.contains(r#"key1="_overflow_""#));
    // A configured rule first hit after the flood still gets its own series.
    let series = |name: &str| {
        format!(r#"ratelimit_service_rate_limit_{name}{{domain="test",key1="narrow"}}"#)
    };
    let victims = VICTIMS as f64;
    assert_eq!(t.metric(&series("total_hits")).await, Some(3.0 * victims));
    assert_eq!(t.metric(&series("over_limit")).await, Some(2.0 * victims));
}

#[tokio::test]
async fn grpc_health_reports_serving_under_every_name_and_sigterm_exits_zero() {
    let (_rules, mut t) = start(&[]).await;
    let mut health = HealthClient::new(t.channel().await);
    for service in [
        "",
        "ratelimit",
        "envoy.service.ratelimit.v3.RateLimitService",
    ] {
        let status = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(status, ServingStatus::Serving as i32, "service {service:?}");
    }
    let exit = t.terminate().await;
    assert!(exit.success(), "{exit}");
}

#[tokio::test]
async fn response_headers_in_the_reference_trio_or_the_ietf_pair() {
    let header_map = |r: &RateLimitResponse| -> Vec<(String, String)> {
        r.response_headers_to_add
            .iter()
            .map(|h| (h.key.clone(), h.value.clone()))
            .collect()
    };
    let (_rules, legacy) = start(&["--limit-response-headers-enabled"]).await;
    let r = legacy
        .call(request("test", vec![descriptor(&[("wide", "h")])]))
        .await
        .unwrap();
    let headers = header_map(&r);
    assert_eq!(headers[0], ("RateLimit-Limit".into(), "10".into()));
    assert_eq!(headers[1], ("RateLimit-Remaining".into(), "9".into()));
    assert_eq!(headers[2].0, "RateLimit-Reset");

    let (_rules, ietf) = start(&["--response-headers", "ietf"]).await;
    let r = ietf
        .call(request("test", vec![descriptor(&[("minute", "h")])]))
        .await
        .unwrap();
    let headers = header_map(&r);
    assert_eq!(
        headers[0],
        ("RateLimit-Policy".into(), "\"per-minute\";q=3;w=60".into())
    );
    assert!(
        headers[1].1.starts_with("\"per-minute\";r=2;t="),
        "{headers:?}"
    );
}

#[test]
fn check_command_summarises_or_lists_every_error() {
    let good = Rules::new(RULES);
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["check", "--config"])
        .arg(good.path())
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("domain test: 12 rules"), "{stdout}");

    let bad = Rules::new(
        "domain: bad\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n  - key: b\n    ratelimit: 3\n",
    );
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["check", "--config"])
        .arg(bad.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("rules.yaml:4:"), "{stderr}");
    assert!(
        stderr.contains("invalid rate limit unit 'fortnight'"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rules.yaml:6:5: config error, unknown key 'ratelimit'"),
        "{stderr}"
    );
}

#[test]
fn serve_refuses_to_start_on_bad_rules_and_says_where() {
    // Rows: rules, and what stderr must contain. `check` and start-up read rules the same way.
    let too_deep = "config nested deeper than 64 levels of lists and maps";
    for (yaml, expected) in [
        (
            "domain: bad\ndescriptors:\n  - value: x\n".to_owned(),
            ["rules.yaml:3:", "descriptor has empty key"],
        ),
        // 2 000 levels once passed on the main thread's large stack and crashed a reload.
        (nested_rules("deep", 2_000), ["rules.yaml:65:", too_deep]),
        (nested_rules("deep", 31), ["rules.yaml:65:", too_deep]),
    ] {
        let bad = Rules::new(&yaml);
        let serve = [
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
        ];
        for command in [&["check"][..], &serve] {
            let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
                .args(command)
                .arg("--config")
                .arg(bad.path())
                .output()
                .unwrap();
            assert!(!out.status.success(), "{command:?}");
            let stderr = String::from_utf8_lossy(&out.stderr);
            for part in expected {
                assert!(stderr.contains(part), "{command:?}: {stderr}");
            }
        }
    }
    let fine = Rules::new(&nested_rules("deep", 30));
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args(["check", "--config"])
        .arg(fine.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA, a server certificate for localhost and a client certificate, as PEM files.
struct Certs {
    dir: tempfile::TempDir,
    ca: String,
    client_cert: String,
    client_key: String,
}

fn certs() -> Certs {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(vec!["localhost".into()]);
    let (client_cert, client_key) = leaf(vec!["client".into()]);
    let dir = tempfile::tempdir().unwrap();
    for (name, pem) in [
        ("ca.pem", ca.pem()),
        ("server.pem", server_cert),
        ("server.key", server_key),
    ] {
        std::fs::write(dir.path().join(name), pem).unwrap();
    }
    Certs {
        dir,
        ca: ca.pem(),
        client_cert,
        client_key,
    }
}

#[tokio::test]
async fn grpc_over_mutual_tls_admits_only_clients_with_a_certificate() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

    let certs = certs();
    let file = |name: &str| certs.dir.path().join(name).to_string_lossy().into_owned();
    let (_rules, t) = start(&[
        "--grpc-tls-cert",
        &file("server.pem"),
        "--grpc-tls-key",
        &file("server.key"),
        "--grpc-client-ca",
        &file("ca.pem"),
    ])
    .await;
    let connect = |identity: Option<Identity>| {
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&certs.ca))
            .domain_name("localhost");
        if let Some(identity) = identity {
            tls = tls.identity(identity);
        }
        let uri = format!("https://localhost:{}", t.grpc.port());
        async move {
            let channel = Channel::from_shared(uri).unwrap().tls_config(tls).unwrap();
            let mut client = RateLimitServiceClient::new(channel.connect().await?);
            client
                .should_rate_limit(request("test", vec![descriptor(&[("wide", "tls")])]))
                .await
                .map_err(|status| -> Box<dyn std::error::Error> { Box::new(status) })
        }
    };
    let with_cert = connect(Some(Identity::from_pem(
        &certs.client_cert,
        &certs.client_key,
    )))
    .await;
    assert_eq!(
        with_cert.unwrap().into_inner().statuses[0].limit_remaining,
        9
    );
    // Each refusal is the server's: its handshake fails, whatever the client reads first
    // (the TLS alert, or the connection closed under it).
    const FAILED: &str = "turnstile_connections_handshake_failed{listener=\"grpc\"}";
    let handshake_failed = async |before: f64, what: &str| {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while t.metric(FAILED).await.unwrap_or(0.0) <= before {
            assert!(
                std::time::Instant::now() < deadline,
                "{what}: no handshake failed on the server"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let before = t.metric(FAILED).await.unwrap_or(0.0);
    let refused = connect(None)
        .await
        .expect_err("a client without a certificate is refused");
    handshake_failed(before, &error_chain(refused.as_ref())).await;
    let before = t.metric(FAILED).await.unwrap_or(0.0);
    let plaintext = t
        .call(request("test", vec![descriptor(&[("wide", "tls")])]))
        .await
        .expect_err("plaintext is refused");
    handshake_failed(before, &error_chain(&plaintext)).await;
}

#[tokio::test]
async fn oversized_messages_are_refused_before_decoding() {
    let (_rules, t) = start(&["--max-message-bytes", "4096"]).await;
    let status = t
        .call(request(
            "test",
            vec![descriptor(&[("wide", &"x".repeat(8192))])],
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::OutOfRange, "{status:?}");
    let fine = t
        .call(request("test", vec![descriptor(&[("wide", "x")])]))
        .await
        .expect("a message within the bound is decided");
    assert_eq!(code(&fine), Code::Ok);
}

#[tokio::test]
async fn the_deciding_rule_is_named_in_metadata_and_its_yaml_name_in_the_status() {
    use envoy_types::pb::google::protobuf::value::Kind;
    let (_rules, t) = start(&[]).await;
    let both = || {
        request(
            "test",
            vec![
                descriptor(&[("key1", "value1"), ("subkey1", "x")]),
                descriptor(&[("narrow", "m")]),
            ],
        )
    };
    let first = t.call(both()).await.unwrap();
    let names: Vec<&str> = first
        .statuses
        .iter()
        .map(|s| s.current_limit.as_ref().unwrap().name.as_str())
        .collect();
    assert_eq!(
        names,
        ["", ""],
        "no YAML name: empty, the path stays private"
    );

    let refused = t.call(both()).await.unwrap();
    let metadata = refused.dynamic_metadata.expect("dynamic_metadata");
    let field = |name: &str| match &metadata.fields[name].kind {
        Some(Kind::StringValue(s)) => s.clone(),
        other => panic!("{name}: {other:?}"),
    };
    assert_eq!(field("rule"), "test.narrow");
    assert_eq!(field("algorithm"), "fixed_window");
    assert_eq!(field("outcome"), "over_limit");
    let Some(Kind::ListValue(list)) = &metadata.fields["descriptors"].kind else {
        panic!("descriptors");
    };
    assert_eq!(list.values.len(), 2);
}

#[tokio::test]
async fn dynamic_metadata_goes_on_the_answers_the_setting_names() {
    // Per answer: an OK, an OVER_LIMIT, and a refusal that the rule's shadow mode answers OK.
    let narrow = || request("test", vec![descriptor(&[("narrow", "n")])]);
    let shadow = || request("test", vec![descriptor(&[("shadow", "s")])]);
    // (--response-metadata, TURNSTILE_RESPONSE_METADATA) -> metadata on
    // (OK, OVER_LIMIT, shadow refusal)
    let rows = [
        (None, None, [false, true, true]),
        (Some("refusals"), None, [false, true, true]),
        (Some("all"), None, [true, true, true]),
        (Some("off"), None, [false, false, false]),
        (None, Some("all"), [true, true, true]),
        // The setting's old boolean values.
        (Some("true"), None, [true, true, true]),
        (None, Some("true"), [true, true, true]),
        (None, Some("false"), [false, false, false]),
    ];
    for (flag, env, expected) in rows {
        let rules = Rules::new(RULES);
        let mut args = vec!["--config", rules.path().to_str().unwrap()];
        args.extend(
            flag.map(|value| ["--response-metadata", value])
                .iter()
                .flatten(),
        );
        let env: Vec<_> = env
            .map(|value| ("TURNSTILE_RESPONSE_METADATA", value))
            .into_iter()
            .collect();
        let t = Turnstile::start_with(&args, &env).await;
        let ok = t.call(narrow()).await.unwrap();
        let over = t.call(narrow()).await.unwrap();
        t.call(shadow()).await.unwrap();
        let shadowed = t.call(shadow()).await.unwrap();
        assert_eq!(
            [code(&ok), code(&over), code(&shadowed)],
            [Code::Ok, Code::OverLimit, Code::Ok]
        );
        assert_eq!(codes(&shadowed), [Code::Ok], "shadow mode lets it through");
        let present = [&ok, &over, &shadowed].map(|r| r.dynamic_metadata.is_some());
        assert_eq!(present, expected, "{flag:?} {env:?}");
    }
}

#[tokio::test]
async fn the_reference_debug_and_prometheus_ports_serve_rules_and_metrics() {
    use support::turnstile::free_port;
    let rules = Rules::new(RULES);
    let debug = format!("127.0.0.1:{}", free_port());
    let prometheus = format!("127.0.0.1:{}", free_port());
    let t = Turnstile::start_with(
        &[
            "--config",
            rules.path().to_str().unwrap(),
            "--debug-addr",
            &debug,
            "--use-prometheus",
            "--prometheus-path",
            "/prom",
        ],
        &[("PROMETHEUS_ADDR", prometheus.as_str())],
    )
    .await;
    t.call(request("test", vec![descriptor(&[("wide", "p")])]))
        .await
        .unwrap();
    let get = |addr: &str, path: &str| {
        let addr = addr.parse().unwrap();
        let path = path.to_owned();
        async move {
            support::turnstile::http(addr, "GET", &path, "")
                .await
                .unwrap()
        }
    };
    let (status, rlconfig) = get(&debug, "/rlconfig").await;
    assert_eq!(status, 200);
    assert!(
        rlconfig.contains("test.wide: unit=HOUR requests_per_unit=10"),
        "{rlconfig}"
    );
    let (status, metrics) = get(&prometheus, "/prom").await;
    assert_eq!(status, 200);
    assert!(
        metrics
            .contains("ratelimit_service_rate_limit_total_hits{domain=\"test\",key1=\"wide\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn global_quota_mode_refuses_only_when_every_limit_is_over() {
    let rules = Rules::new(RULES);
    let t = Turnstile::start_with(
        &["--config", rules.path().to_str().unwrap()],
        &[("QUOTA_MODE", "true")],
    )
    .await;
    let both = || {
        request(
            "test",
            vec![descriptor(&[("narrow", "q")]), descriptor(&[("wide", "q")])],
        )
    };
    t.call(both()).await.unwrap();
    let second = t.call(both()).await.unwrap();
    assert_eq!(
        codes(&second),
        [Code::OverLimit, Code::Ok],
        "statuses keep their own codes"
    );
    assert_eq!(code(&second), Code::Ok, "not every quota limit is over");
    let alone = t
        .call(request("test", vec![descriptor(&[("narrow", "q")])]))
        .await
        .unwrap();
    assert_eq!(code(&alone), Code::OverLimit, "its only limit is over");
}

#[tokio::test]
async fn several_limits_on_one_descriptor_are_enforced_together_and_the_tightest_reported() {
    let (_rules, t) = start(&[]).await;
    let one = || request("test", vec![descriptor(&[("layered", "x")])]);
    let limit_of = |r: &RateLimitResponse| {
        let l = r.statuses[0].current_limit.as_ref().unwrap();
        (l.name.clone(), l.requests_per_unit, l.unit)
    };
    let first = t.call(one()).await.unwrap();
    assert_eq!(
        remaining(&first),
        [1],
        "the per-minute bucket is tighter than 4 of 5 per hour"
    );
    assert_eq!(limit_of(&first), ("layered".into(), 2, Unit::Minute as i32));
    t.call(one()).await.unwrap();
    let refused = t.call(one()).await.unwrap();
    assert_eq!(code(&refused), Code::OverLimit);
    assert_eq!(
        limit_of(&refused).1,
        2,
        "the refusing limit is the one reported"
    );
    let retry = reset(&refused.statuses[0]);
    assert!(
        retry > Duration::from_secs(29) && retry <= Duration::from_secs(30),
        "the bucket's next token (one per 30 s): {retry:?}"
    );
}

#[tokio::test]
async fn a_custom_window_limits_over_its_own_span() {
    let (_rules, t) = start(&[]).await;
    let one = || request("test", vec![descriptor(&[("short", "x")])]);
    assert_eq!(code(&t.call(one()).await.unwrap()), Code::Ok);
    let refused = t.call(one()).await.unwrap();
    assert_eq!(code(&refused), Code::OverLimit);
    let retry = reset(&refused.statuses[0]);
    assert!(
        retry > Duration::from_millis(1_500) && retry <= Duration::from_secs(2),
        "{retry:?}"
    );
    let limit = refused.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!(
        limit.unit,
        Unit::Second as i32,
        "the longest unit within 2 s"
    );
}

#[tokio::test]
async fn share_threshold_makes_every_matching_value_count_on_one_counter() {
    let rules = Rules::new(
        "domain: files\ndescriptors:\n  - key: file\n    value: files/*\n    share_threshold: true\n    rate_limit: {unit: hour, requests_per_unit: 3}\n  - key: file\n    value: test1\n    rate_limit: {unit: hour, requests_per_unit: 1}\n  - key: own\n    value: own/*\n    rate_limit: {unit: hour, requests_per_unit: 3}\n",
    );
    let t = Turnstile::start(rules.path(), &[]).await;
    let hit = |value: &str| request("files", vec![descriptor(&[("file", value)])]);
    for value in ["files/a.pdf", "files/b.csv", "files/c.txt"] {
        assert_eq!(code(&t.call(hit(value)).await.unwrap()), Code::Ok);
    }
    assert_eq!(
        code(&t.call(hit("files/d.doc")).await.unwrap()),
        Code::OverLimit,
        "the three files before it used the shared quota"
    );
    assert_eq!(
        remaining(&t.call(hit("test1")).await.unwrap()),
        [0],
        "an exact value has its own"
    );
    let own = |value: &str| request("files", vec![descriptor(&[("own", value)])]);
    for value in ["own/a", "own/b", "own/c", "own/d"] {
        assert_eq!(
            remaining(&t.call(own(value)).await.unwrap()),
            [2],
            "{value} counts alone"
        );
    }
}

#[tokio::test]
async fn stats_are_exported_to_statsd_under_the_reference_names() {
    use std::collections::HashMap;
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let port = socket.local_addr().unwrap().port().to_string();
    let rules = Rules::new(RULES);
    let t = Turnstile::start_with(
        &["--config", rules.path().to_str().unwrap()],
        &[
            ("USE_STATSD", "true"),
            ("STATSD_HOST", "127.0.0.1"),
            ("STATSD_PORT", &port),
            ("STATS_FLUSH_INTERVAL", "100ms"),
        ],
    )
    .await;
    for _ in 0..2 {
        t.call(request("test", vec![descriptor(&[("narrow", "s")])]))
            .await
            .unwrap();
    }
    let mut totals: HashMap<String, u64> = HashMap::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut buf = [0u8; 2048];
    let done = |t: &HashMap<String, u64>| {
        t.get("ratelimit.service.rate_limit.test.narrow.over_limit") == Some(&1)
            && t.get("ratelimit_server.ShouldRateLimit.total_requests") == Some(&2)
    };
    while !done(&totals) {
        let received = tokio::time::timeout_at(deadline, socket.recv(&mut buf))
            .await
            .expect("statsd lines in time")
            .unwrap();
        for line in std::str::from_utf8(&buf[..received]).unwrap().lines() {
            let (name, rest) = line.split_once(':').unwrap();
            let value: u64 = rest.strip_suffix("|c").unwrap().parse().unwrap();
            *totals.entry(name.to_owned()).or_default() += value;
        }
    }
    assert_eq!(
        totals["ratelimit.service.rate_limit.test.narrow.total_hits"],
        2
    );
    assert_eq!(
        totals["ratelimit.service.rate_limit.test.narrow.within_limit"],
        1
    );
    assert_eq!(totals["ratelimit_server.ShouldRateLimit.total_requests"], 2);
}

/// The reference's documented examples (its README's examples 1 to 7 and 9), rules written in
/// its format, answers as it documents them.
#[tokio::test]
async fn the_reference_readme_examples_answer_as_documented() {
    let rules = Rules::new(
        "domain: mongo_cps\ndescriptors:\n  - key: database\n    value: users\n    rate_limit: {unit: second, requests_per_unit: 500}\n  - key: database\n    value: default\n    rate_limit: {unit: second, requests_per_unit: 500}\n",
    );
    rules.write(
        "messaging.yaml",
        "domain: messaging\ndescriptors:\n  - key: message_type\n    value: marketing\n    descriptors:\n      - key: to_number\n        rate_limit: {unit: day, requests_per_unit: 5}\n  - key: to_number\n    rate_limit: {unit: day, requests_per_unit: 100}\n",
    );
    rules.write(
        "edge.yaml",
        "domain: edge_proxy_per_ip\ndescriptors:\n  - key: remote_address\n    rate_limit: {unit: second, requests_per_unit: 10}\n  - key: remote_address\n    value: 50.0.0.5\n    rate_limit: {unit: second, requests_per_unit: 0}\n",
    );
    rules.write(
        "depth.yaml",
        "domain: shallow\ndescriptors:\n  - key: key\n    value: value\n    rate_limit: {unit: second, requests_per_unit: 300}\n---\ndomain: deep\ndescriptors:\n  - key: key\n    value: value\n    descriptors:\n      - key: subkey\n        rate_limit: {unit: second, requests_per_unit: 300}\n",
    );
    rules.write(
        "internal.yaml",
        "domain: internal\ndescriptors:\n  - key: ldap\n    rate_limit: {unlimited: true}\n  - key: azure\n    rate_limit: {unit: minute, requests_per_unit: 100}\n",
    );
    rules.write(
        "shadow.yaml",
        "domain: example6\ndescriptors:\n  - key: service\n    descriptors:\n      - key: user\n        value: user-a\n        shadow_mode: true\n        rate_limit: {unit: second, requests_per_unit: 10}\n      - key: user\n        value: user-b\n        rate_limit: {unit: second, requests_per_unit: 20}\n",
    );
    rules.write(
        "replaces.yaml",
        "domain: example7\ndescriptors:\n  - key: key_1\n    value: value_1\n    descriptors:\n      - key: user\n        value: bkthomps\n        rate_limit: {name: specific_limit, unit: second, requests_per_unit: 5}\n  - key: key_2\n    value: value_2\n    descriptors:\n      - key: user\n        value: bkthomps\n        rate_limit: {replaces: [{name: specific_limit}], unit: second, requests_per_unit: 10}\n",
    );
    rules.write(
        "wildcards.yaml",
        "domain: example9\ndescriptors:\n  - key: path\n    value: /api/*/action\n    rate_limit: {unit: minute, requests_per_unit: 20}\n  - key: route\n    value: /api/*/resource/*/action\n    rate_limit: {unit: minute, requests_per_unit: 20}\n",
    );
    let t = Turnstile::start(rules.path(), &[]).await;
    let limit_of = |r: &RateLimitResponse, i: usize| {
        r.statuses[i]
            .current_limit
            .as_ref()
            .map(|l| (l.requests_per_unit, l.unit))
    };

    // 1: a limit per value.
    let r = t
        .call(request(
            "mongo_cps",
            vec![descriptor(&[("database", "users")])],
        ))
        .await
        .unwrap();
    assert_eq!(limit_of(&r, 0), Some((500, Unit::Second as i32)));
    assert_eq!(remaining(&r), [499]);

    // 2: nested descriptors, several in one request, the answer an OR of all.
    let both = || {
        request(
            "messaging",
            vec![
                descriptor(&[("message_type", "marketing"), ("to_number", "2061111111")]),
                descriptor(&[("to_number", "2061111111")]),
            ],
        )
    };
    let r = t.call(both()).await.unwrap();
    assert_eq!(limit_of(&r, 0), Some((5, Unit::Day as i32)));
    assert_eq!(limit_of(&r, 1), Some((100, Unit::Day as i32)));
    for _ in 0..4 {
        t.call(both()).await.unwrap();
    }
    let sixth = t.call(both()).await.unwrap();
    assert_eq!(
        (code(&sixth), codes(&sixth)),
        (Code::OverLimit, vec![Code::OverLimit, Code::Ok])
    );

    // 3: key and value beat key alone.
    let ip = |a: &str| {
        request(
            "edge_proxy_per_ip",
            vec![descriptor(&[("remote_address", a)])],
        )
    };
    assert_eq!(remaining(&t.call(ip("50.0.0.1")).await.unwrap()), [9]);
    assert_eq!(
        code(&t.call(ip("50.0.0.5")).await.unwrap()),
        Code::OverLimit
    );

    // 4: the request's depth must be the rule's.
    let two = |domain: &str| {
        request(
            domain,
            vec![descriptor(&[("key", "value"), ("subkey", "subvalue")])],
        )
    };
    assert_eq!(limit_of(&t.call(two("shallow")).await.unwrap(), 0), None);
    assert_eq!(
        limit_of(&t.call(two("deep")).await.unwrap(), 0),
        Some((300, Unit::Second as i32))
    );

    // 5: unlimited answers OK with the largest remaining.
    let r = t
        .call(request(
            "internal",
            vec![descriptor(&[("ldap", "x")]), descriptor(&[("azure", "x")])],
        ))
        .await
        .unwrap();
    assert_eq!(remaining(&r), [u32::MAX, 99]);

    // 6: a shadow rule never limits; its sibling does.
    let user = |u: &str| {
        request(
            "example6",
            vec![descriptor(&[("service", "auth-service"), ("user", u)])],
        )
    };
    for _ in 0..12 {
        assert_eq!(code(&t.call(user("user-a")).await.unwrap()), Code::Ok);
    }
    // 21 calls in one second window: start well before the window ends.
    clear_of_end(Duration::from_secs(1), Duration::from_millis(500)).await;
    let mut codes_b = Vec::new();
    for _ in 0..21 {
        codes_b.push(code(&t.call(user("user-b")).await.unwrap()));
    }
    assert_eq!(
        codes_b.iter().filter(|c| **c == Code::OverLimit).count(),
        1,
        "the 21st in one second"
    );

    // 7: replaces.
    let r = t
        .call(request(
            "example7",
            vec![
                descriptor(&[("key_1", "value_1"), ("user", "bkthomps")]),
                descriptor(&[("key_2", "value_2"), ("user", "bkthomps")]),
            ],
        ))
        .await
        .unwrap();
    assert_eq!(
        (limit_of(&r, 0), limit_of(&r, 1)),
        (None, Some((10, Unit::Second as i32)))
    );
    let alone = t
        .call(request(
            "example7",
            vec![descriptor(&[("key_1", "value_1"), ("user", "bkthomps")])],
        ))
        .await
        .unwrap();
    assert_eq!(limit_of(&alone, 0), Some((5, Unit::Second as i32)));

    // 9: wildcards in the middle, and several.
    let path = |k: &str, v: &str| request("example9", vec![descriptor(&[(k, v)])]);
    assert!(limit_of(&t.call(path("path", "/api/123/action")).await.unwrap(), 0).is_some());
    assert!(limit_of(&t.call(path("path", "/api/123/other")).await.unwrap(), 0).is_none());
    assert!(
        limit_of(
            &t.call(path("route", "/api/v1/resource/123/action"))
                .await
                .unwrap(),
            0
        )
        .is_some()
    );
}

#[tokio::test]
async fn the_reference_response_metadata_echoes_the_request_and_merges_passed_rules_metadata() {
    use envoy_types::pb::google::protobuf::value::Kind;
    let rules = Rules::new(
        "domain: meta\ndescriptors:\n  - key: a\n    metadata: {name: service_1, shared: {x: 1}}\n    rate_limit: {unit: hour, requests_per_unit: 5}\n  - key: b\n    metadata: {name: service_2, shared: {x: 2, y: true}}\n    rate_limit: {unit: hour, requests_per_unit: 5}\n  - key: c\n    metadata: {blocked: yes}\n    rate_limit: {unit: hour, requests_per_unit: 0}\n",
    );
    let t = Turnstile::start_with(
        &["--config", rules.path().to_str().unwrap()],
        &[("RESPONSE_DYNAMIC_METADATA", "true")],
    )
    .await;
    let mut r = request(
        "meta",
        vec![
            descriptor(&[("a", "1")]),
            descriptor(&[("b", "2")]),
            descriptor(&[("c", "3")]),
        ],
    );
    r.hits_addend = 2;
    let answer = t.call(r).await.unwrap();
    let m = answer.dynamic_metadata.expect("dynamic_metadata");
    let json = |v: &envoy_types::pb::google::protobuf::Value| -> serde_json::Value {
        fn conv(v: &envoy_types::pb::google::protobuf::Value) -> serde_json::Value {
            match &v.kind {
                Some(Kind::StringValue(s)) => serde_json::Value::from(s.as_str()),
                Some(Kind::NumberValue(n)) => serde_json::Value::from(*n),
                Some(Kind::BoolValue(b)) => serde_json::Value::from(*b),
                Some(Kind::ListValue(l)) => l.values.iter().map(conv).collect(),
                Some(Kind::StructValue(s)) => {
                    s.fields.iter().map(|(k, v)| (k.clone(), conv(v))).collect()
                }
                _ => serde_json::Value::Null,
            }
        }
        conv(v)
    };
    let field = |name: &str| json(&m.fields[name]);
    assert_eq!(field("domain"), "meta");
    assert_eq!(field("hitsAddend"), 2.0);
    assert_eq!(field("descriptors")[2]["entries"][0], "c=3");
    // a and b passed: their metadata merged, the first value winning; c was over its limit.
    assert_eq!(
        field("metadata"),
        serde_json::json!({"name": "service_1", "shared": {"x": 1.0, "y": true}})
    );
    assert_eq!(field("outcome"), "over_limit");
    assert_eq!(field("rule"), "meta.c");
}

// `turnstile explain`: which rule a descriptor matches, and where an instance's counter stands.

/// Runs `turnstile explain --config <rules> <args>`: exit code, stdout, stderr.
fn explain(rules: &std::path::Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .arg("explain")
        .arg("--config")
        .arg(rules)
        .args(args)
        .output()
        .unwrap();
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

#[test]
fn explain_names_the_matching_rule_or_says_why_none_matches() {
    let good = Rules::new(RULES);
    let bad = Rules::new("domain: bad\ndescriptors:\n  - value: x\n");
    let (good, bad) = (good.path(), bad.path());
    // (rules, arguments, exit code, what stdout (exit 0 or 1) or stderr (exit 2) says)
    let table: &[(&std::path::Path, &[&str], i32, &[&str])] = &[
        (
            good,
            &["--domain", "test", "minute=anything"],
            0,
            &[
                "descriptor 1 [minute=anything]\n  rule         test.minute\n",
                "  name         per-minute\n  limit        3 per MINUTE, fixed_window\n",
                "  shadow_mode  no\n  quota_mode   no\n",
            ],
        ),
        (
            good,
            &["--domain", "test", "bucket=x"],
            0,
            &["limit        1 per SECOND, token_bucket, burst 2\n"],
        ),
        (
            good,
            &["--domain", "test", "layered=x"],
            0,
            &[
                "limit        5 per HOUR, fixed_window\n",
                "also         2 per MINUTE, token_bucket, burst 2\n",
            ],
        ),
        (
            good,
            &["--domain", "test", "short=x"],
            0,
            &["1 per SECOND, sliding_window, window 2s\n"],
        ),
        (
            good,
            &["--domain", "test", "shadow=x"],
            0,
            &["shadow_mode  yes: counted and reported, never refuses"],
        ),
        (
            good,
            &["--domain", "test", "unlimited=x"],
            0,
            &["limit        unlimited (never refused)"],
        ),
        (
            good,
            &["--domain", "test", "b=x"],
            0,
            &["replaces     a-rule"],
        ),
        // A value may hold commas and '=' as a positional entry.
        (
            good,
            &["--domain", "test", "key1=value1", "subkey1=a,b=c"],
            0,
            &["[key1=value1, subkey1=a,b=c]\n  rule         test.key1_value1.subkey1\n"],
        ),
        (
            good,
            &["--domain", "test", "key1=value1"],
            1,
            &["no rule matches: every entry matches, but the node they reach has no rate_limit"],
        ),
        (
            good,
            &["--domain", "test", "key1=other", "subkey1=x"],
            1,
            &["no rule matches: entry 1 (key1=other): rules have this key, but no value"],
        ),
        (
            good,
            &["--domain", "test", "minute=x", "extra=y"],
            1,
            &["no rule matches: entry 2 (extra=y): the rules' path ends before it"],
        ),
        (
            good,
            &["--domain", "test", "Minute=x"],
            1,
            &["no rule at this depth has the key 'Minute' (keys are case-sensitive)"],
        ),
        (
            good,
            &["--domain", "other", "minute=x"],
            1,
            &[
                "domain other: no rules (loaded domains: test)",
                "no rule matches: the domain has no rules",
            ],
        ),
        // Several descriptors: each is answered, in order; one miss makes the exit code 1.
        (
            good,
            &[
                "--domain", "test", "-d", "wide=1", "-d", "nope=1", "narrow=2",
            ],
            1,
            &[
                "descriptor 1 [wide=1]\n  rule         test.wide\n",
                "descriptor 2 [nope=1]\n  no rule matches",
                "descriptor 3 [narrow=2]\n  rule         test.narrow\n",
            ],
        ),
        (good, &["--domain", "test"], 2, &["no descriptor"]),
        (
            good,
            &["--domain", "test", "novalue"],
            2,
            &["'novalue' is not an entry"],
        ),
        (
            good,
            &["--domain", "test", "=v"],
            2,
            &["'=v' is not an entry"],
        ),
        (
            bad,
            &["--domain", "bad", "k=v"],
            2,
            &[
                "the rules do not load",
                "rules.yaml:3:5: descriptor has empty key",
            ],
        ),
    ];
    for (rules, args, code, says) in table {
        let (got, stdout, stderr) = explain(rules, args);
        assert_eq!(got, Some(*code), "{args:?}\n{stdout}{stderr}");
        let text = if *code == 2 { &stderr } else { &stdout };
        for fragment in *says {
            assert!(
                text.contains(fragment),
                "{args:?}: no {fragment:?} in\n{text}"
            );
        }
        if *code != 2 {
            assert!(stderr.is_empty(), "{args:?}: {stderr}");
        }
    }
}

#[tokio::test]
async fn explain_reads_an_instance_counters_without_charging_them() {
    let (rules, t) = start(&[]).await;
    for _ in 0..2 {
        t.call(request("test", vec![descriptor(&[("wide", "w")])]))
            .await
            .unwrap();
    }
    let grpc = t.grpc.to_string();
    let args = [
        "--domain",
        "test",
        "--instance",
        &grpc,
        "-d",
        "wide=w",
        "-d",
        "narrow=n",
        "-d",
        "nope=1",
    ];
    // Asked twice: the reads themselves must not count.
    for _ in 0..2 {
        let (code, stdout, stderr) = explain(rules.path(), &args);
        assert_eq!(code, Some(1), "{stdout}{stderr}");
        assert!(
            stdout.contains("  now          remaining 8 of 10 per HOUR, resets in "),
            "{stdout}"
        );
        assert!(
            stdout.contains("  now          remaining 1 of 1 per HOUR, resets in "),
            "{stdout}"
        );
        assert!(
            stdout.contains("  now          OK, no limit applies on the instance"),
            "{stdout}"
        );
        assert!(!stdout.contains("over the limit"), "{stdout}");
    }
    let answer = t
        .call(request("test", vec![descriptor(&[("narrow", "n")])]))
        .await
        .unwrap();
    assert_eq!(code(&answer), Code::Ok, "the reads charged narrow");
    let (_, stdout, _) = explain(rules.path(), &args);
    assert!(
        stdout.contains("remaining 0 of 1 per HOUR, resets in "),
        "{stdout}"
    );
    assert!(
        stdout.contains(": the next hit is over the limit"),
        "{stdout}"
    );

    // An instance that does not answer is an error (2), not a verdict.
    drop(t);
    let (code, _, stderr) = explain(rules.path(), &args);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot ask the instance at http://{grpc}")),
        "{stderr}"
    );
}

// Connections (issue 12, item 5; issue 59): a connection that never finishes its handshake,
// a peer that stops answering, a flood past the cap or past the open-files limit, from one
// address or many, must not hold the service or keep a new client out; idle clients that
// answer pings (Envoy's connections) stay, and busy ones are never closed.

mod connections {
    use std::net::{IpAddr, SocketAddr};
    use std::time::{Duration, Instant};

    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;
    use tonic::transport::Channel;

    use super::{RULES, start};
    use crate::support::turnstile::{Rules, Turnstile, descriptor, request};

    /// A client's HTTP/2 preface and an empty SETTINGS frame.
    const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";

    /// Send `first`, then `trickle` one byte at a time every 200 ms (if any), reading what
    /// the server sends: how long until it closed the connection and what it sent, or None
    /// if it was still open after `limit`.
    async fn closed_after(
        stream: TcpStream,
        first: &[u8],
        trickle: &[u8],
        limit: Duration,
    ) -> Option<(Duration, String)> {
        let started = Instant::now();
        let (mut reader, mut writer) = stream.into_split();
        writer.write_all(first).await.ok()?;
        let trickle = trickle.to_vec();
        let writer = tokio::spawn(async move {
            for byte in trickle.iter().cycle() {
                tokio::time::sleep(Duration::from_millis(200)).await;
                if writer.write_all(&[*byte]).await.is_err() {
                    return;
                }
            }
            std::future::pending::<()>().await
        });
        let mut received = Vec::new();
        let drain = async {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = reader.read(&mut buf).await {
                received.extend_from_slice(&buf[..n]);
            }
        };
        let closed = tokio::time::timeout(limit, drain).await;
        writer.abort();
        closed.ok().map(|()| {
            (
                started.elapsed(),
                String::from_utf8_lossy(&received).into_owned(),
            )
        })
    }

    async fn connect(addr: std::net::SocketAddr) -> TcpStream {
        TcpStream::connect(addr).await.expect("TCP connect")
    }

    /// 127.0.0.`last`: each stands for a peer of its own.
    fn loopback(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    /// A connection from `source`.
    async fn connect_from(source: IpAddr, to: SocketAddr) -> std::io::Result<TcpStream> {
        let socket = tokio::net::TcpSocket::new_v4()?;
        socket.bind(SocketAddr::new(source, 0))?;
        socket.connect(to).await
    }

    async fn client(t: &Turnstile) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::new(t.channel().await)
    }

    /// One connection from `source`, opened at once.
    async fn channel_from(
        t: &Turnstile,
        source: IpAddr,
    ) -> Result<Channel, tonic::transport::Error> {
        Channel::from_shared(format!("http://{}", t.grpc))
            .expect("uri")
            .local_address(Some(source))
            .connect_timeout(Duration::from_secs(1))
            .connect()
            .await
    }

    async fn client_from(
        t: &Turnstile,
        source: IpAddr,
    ) -> Result<RateLimitServiceClient<Channel>, tonic::transport::Error> {
        Ok(RateLimitServiceClient::new(channel_from(t, source).await?))
    }

    /// Whether a call on a new connection is answered within `limit`, trying again while
    /// connections are refused.
    async fn new_connection_answers_within(t: &Turnstile, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let endpoint = Channel::from_shared(format!("http://{}", t.grpc)).expect("uri");
            let connect = tokio::time::timeout(Duration::from_secs(1), endpoint.connect());
            if let Ok(Ok(channel)) = connect.await
                && decide(&mut RateLimitServiceClient::new(channel))
                    .await
                    .is_ok()
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    async fn decide(client: &mut RateLimitServiceClient<Channel>) -> Result<(), tonic::Status> {
        let call =
            client.should_rate_limit(request("test", vec![descriptor(&[("unlimited", "x")])]));
        match tokio::time::timeout(Duration::from_secs(3), call).await {
            Ok(answer) => answer.map(drop),
            Err(_) => Err(tonic::Status::deadline_exceeded("no answer in 3 s")),
        }
    }

    #[tokio::test]
    async fn grpc_connections_without_a_handshake_or_deaf_to_pings_are_closed_live_idle_ones_stay()
    {
        let (_rules, t) = start(&[
            "--grpc-handshake-timeout",
            "1s",
            "--grpc-keepalive-interval",
            "1s",
            "--grpc-keepalive-timeout",
            "1s",
        ])
        .await;
        let mut live = client(&t).await;
        decide(&mut live).await.expect("a first call");
        // (client, what it sends before going silent, closed no sooner than)
        let rows: [(&str, &[u8], Duration); 4] = [
            ("silent TCP", b"", Duration::from_secs(1)),
            ("half a preface", &H2_PREFACE[..10], Duration::from_secs(1)),
            (
                "HTTP/1 on the gRPC port",
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                Duration::ZERO,
            ),
            // Pinged after 1 s of silence, closed 1 s later.
            (
                "preface, then deaf to pings",
                H2_PREFACE,
                Duration::from_secs(2),
            ),
        ];
        let closed = futures_util::future::join_all(rows.iter().map(|(_, first, _)| async {
            closed_after(connect(t.grpc).await, first, b"", Duration::from_secs(10)).await
        }))
        .await;
        for ((name, _, sooner), closed) in rows.iter().zip(closed) {
            let (after, _) = closed.unwrap_or_else(|| panic!("{name}: still open after 10 s"));
            assert!(
                after >= sooner.mul_f64(0.9),
                "{name}: closed after {after:?}"
            );
        }
        // The live client has been idle through several keepalive periods: its connection is
        // the one open gRPC connection, and it answers.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            t.metric("turnstile_connections_open{listener=\"grpc\"}")
                .await,
            Some(1.0)
        );
        decide(&mut live)
            .await
            .expect("the idle client's connection stays");
        assert_eq!(
            t.metric("turnstile_connections_handshake_failed{listener=\"grpc\"}")
                .await,
            Some(3.0)
        );
    }

    /// A gRPC connection past its maximum age (`GRPC_MAX_CONNECTION_AGE`, 600 ms ± 10 % here)
    /// is asked to close (GOAWAY) and closes once its calls are done; one whose call is still
    /// open when its grace ends (`GRPC_MAX_CONNECTION_AGE_GRACE`, 600 ms) is closed then, the
    /// call cut. Rows: what the connection holds, and when it must close after opening (a
    /// second's margin for a busy machine on the late side).
    #[tokio::test]
    async fn a_grpc_connection_closes_at_its_maximum_age_or_when_its_grace_ends() {
        use prost::Message;

        use super::SHOULD_RATE_LIMIT;
        use crate::support::raw::{RawBody, framed, raw_connection, raw_request};

        let (_rules, t) = start(&[
            "--grpc-max-connection-age",
            "600ms",
            "--grpc-max-connection-age-grace",
            "600ms",
            "--request-timeout",
            "10s",
        ])
        .await;
        let message = request("test", vec![descriptor(&[("unlimited", "x")])]).encode_to_vec();
        let ms = Duration::from_millis;
        let rows = [
            ("idle", false, ms(540)..ms(1_660)),
            (
                "a call whose message never ends",
                true,
                ms(1_140)..ms(2_260),
            ),
        ];
        for (name, stalled, within) in rows {
            let opened = Instant::now();
            let (mut send, driver) = raw_connection(&t).await;
            let call = stalled.then(|| {
                let body = RawBody {
                    data: Some(framed(0, message.len() + 1, &message)),
                    stall: true,
                    ..Default::default()
                };
                // The caller would wait an hour: the 10 s request timeout bounds the call.
                send.send_request(raw_request(SHOULD_RATE_LIMIT, "1H", body))
            });
            let closed = tokio::time::timeout(Duration::from_secs(5), driver).await;
            let after = opened.elapsed();
            assert!(closed.is_ok(), "{name}: still open after {after:?}");
            assert!(within.contains(&after), "{name}: closed after {after:?}");
            if let Some(call) = call {
                let answer = call.await;
                assert!(answer.is_err(), "{name}: the stalled call got {answer:?}");
            }
        }
        assert!(
            new_connection_answers_within(&t, Duration::from_secs(2)).await,
            "a new connection is served"
        );
    }

    /// Wait (5 s at most) until the server counts `open` gRPC connections: one a client
    /// closed counts until the server has seen it close.
    async fn until_grpc_open(t: &Turnstile, open: f64) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while t
            .metric("turnstile_connections_open{listener=\"grpc\"}")
            .await
            != Some(open)
        {
            assert!(
                Instant::now() < deadline,
                "the closed connection still counts"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// At the cap, a newcomer from a peer holding as many connections as any is closed at
    /// accept (one from a smaller peer would take an idle connection's place: see
    /// `a_flood_never_keeps_a_new_client_out`). A cap of 4 gives each peer 2.
    #[tokio::test]
    async fn past_the_connection_cap_new_connections_are_closed_at_accept_open_ones_keep_working() {
        let (_rules, t) =
            start(&["--grpc-max-connections", "4", "--http-max-connections", "2"]).await;
        let mut clients = Vec::new();
        for source in [1, 1, 2, 2].map(loopback) {
            let mut c = client_from(&t, source).await.expect("connect");
            decide(&mut c).await.expect("a connection within the cap");
            clients.push(c);
        }
        // Closed at once: the handshake timeout (10 s by default) has nothing to do with it.
        // Watched past that timeout, so that a close by it is seen, and fails the bound.
        let (after, _) = closed_after(
            connect_from(loopback(2), t.grpc).await.expect("connect"),
            H2_PREFACE,
            b"",
            Duration::from_secs(15),
        )
        .await
        .expect("the connection past the gRPC cap is closed");
        assert!(
            after < Duration::from_secs(5),
            "closed after {after:?}: by the handshake timeout, not at accept"
        );
        for c in &mut clients {
            decide(c)
                .await
                .expect("connections within the cap keep working");
        }
        // The admin port: two idle connections fill it, the third is closed at accept.
        let held = [connect(t.http).await, connect(t.http).await];
        closed_after(connect(t.http).await, b"", b"", Duration::from_secs(5))
            .await
            .expect("the connection past the HTTP cap is closed");
        drop(held);
        // The admin port answers again once the server has seen those close; each attempt
        // before that is one more refusal.
        let mut http_refused = 1.0;
        let deadline = Instant::now() + Duration::from_secs(5);
        while t
            .http_get("/healthcheck")
            .await
            .map(|(status, _)| status)
            .ok()
            != Some(200)
        {
            assert!(Instant::now() < deadline, "the admin port stays full");
            http_refused += 1.0;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // A slot freed, once the server has seen the close, is taken again at once.
        clients.pop();
        until_grpc_open(&t, 3.0).await;
        decide(&mut client_from(&t, loopback(2)).await.expect("connect"))
            .await
            .expect("a new connection in the freed slot");
        for (listener, refused) in [("grpc", 1.0), ("http", http_refused)] {
            let series = format!("turnstile_connections_refused{{listener=\"{listener}\"}}");
            assert_eq!(t.metric(&series).await, Some(refused), "{series}");
        }
        assert_eq!(
            t.metric("turnstile_connections_closed_to_make_room{listener=\"grpc\"}")
                .await,
            Some(0.0)
        );
    }

    /// One peer address may hold only its share of the gRPC port's connections: past it its
    /// new ones are closed at accept (every test client is 127.0.0.1, the one peer here),
    /// while the port as a whole has room; a share freed is taken again.
    #[tokio::test]
    async fn one_peer_cannot_hold_more_than_its_share_of_connections() {
        let (_rules, t) = start(&["--grpc-max-connections-per-peer", "2"]).await;
        let mut clients = Vec::new();
        for _ in 0..2 {
            let mut c = client(&t).await;
            decide(&mut c).await.expect("a connection within the share");
            clients.push(c);
        }
        closed_after(
            connect(t.grpc).await,
            H2_PREFACE,
            b"",
            Duration::from_secs(5),
        )
        .await
        .expect("the peer's third connection is closed");
        assert_eq!(
            t.metric("turnstile_connections_refused{listener=\"grpc\"}")
                .await,
            Some(1.0)
        );
        for c in &mut clients {
            decide(c)
                .await
                .expect("the peer's open connections keep working");
        }
        clients.pop();
        until_grpc_open(&t, 1.0).await;
        decide(&mut client(&t).await)
            .await
            .expect("a new connection in the peer's freed share");
    }

    /// What a flooding connection does once open.
    #[derive(Clone, Copy, Debug)]
    enum Flooding {
        /// Nothing: it stays in its handshake until the handshake timeout.
        IdleTcp,
        /// The HTTP/2 preface and SETTINGS, then nothing: served, and idle.
        IdleAfterPreface,
    }

    /// `per_address` connections from each of `addresses` (127.0.0.`first`, the next ...),
    /// 256 at a time; the open ones (the server closes some at accept, or later for a
    /// newcomer).
    async fn flood(
        t: &Turnstile,
        first: u8,
        addresses: u8,
        per_address: usize,
        flooding: Flooding,
    ) -> Vec<TcpStream> {
        use futures_util::StreamExt;
        let sources =
            (0..addresses).flat_map(|n| std::iter::repeat_n(loopback(first + n), per_address));
        let grpc = t.grpc;
        futures_util::stream::iter(sources)
            .map(|source| async move {
                let mut stream = connect_from(source, grpc).await.ok()?;
                if let Flooding::IdleAfterPreface = flooding {
                    stream.write_all(H2_PREFACE).await.ok()?;
                }
                Some(stream)
            })
            .buffer_unordered(256)
            .filter_map(|stream| async { stream })
            .collect()
            .await
    }

    /// The gRPC port's `series` counter (or gauge), 0 when absent.
    async fn grpc_metric(t: &Turnstile, series: &str) -> f64 {
        let series = format!("turnstile_connections_{series}{{listener=\"grpc\"}}");
        t.metric(&series).await.unwrap_or(0.0)
    }

    /// Wait (10 s at most) until the server has seen each of `flooded` connections: each is
    /// open, refused, or was closed to make room.
    async fn until_seen(t: &Turnstile, flooded: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut seen = 0.0;
            for series in ["open", "refused", "closed_to_make_room"] {
                seen += grpc_metric(t, series).await;
            }
            if seen >= flooded as f64 {
                return;
            }
            assert!(Instant::now() < deadline, "{seen} of {flooded} seen");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// One call on a fresh connection from 127.0.0.1, at the first try: the connection and
    /// the call each within their bound; how long they took, and the client (which keeps
    /// its connection, as Envoy does).
    async fn fresh_call(
        t: &Turnstile,
    ) -> Result<(Duration, RateLimitServiceClient<Channel>), String> {
        let started = Instant::now();
        let mut client = client_from(t, loopback(1))
            .await
            .map_err(|e| format!("connect: {e:?}"))?;
        decide(&mut client).await.map_err(|e| format!("{e:?}"))?;
        Ok((started.elapsed(), client))
    }

    /// No client can keep others out of the gRPC port (issue 59): with the port flooded by
    /// one address or ten (each 127.0.0.x a peer of its own), idle in their handshake or
    /// idle after it, at the default limits or under 256 open files, a client from
    /// 127.0.0.1 gets a fresh connection and its call answered at the first try, three
    /// times, and again right after the flood ends. One address cannot fill the port (a
    /// peer has at most half of it); ten can, and the newcomer then takes the place of an
    /// idle connection of the biggest.
    ///
    /// At the default limits a flood of ten addresses fills the port's 10 000 connections
    /// as in the issue; a flood of one holds its 1 000. Rows: (open files, addresses, each
    /// address's connections, what they do).
    async fn flooded(rows: &[(Option<usize>, u8, usize, Flooding)]) {
        for &(open_files, addresses, per_address, flooding) in rows {
            let row = format!("{open_files:?} files, {addresses} x {per_address} {flooding:?}");
            crate::support::turnstile::raise_open_files_limit(
                usize::from(addresses) * per_address + 1_000,
            );
            let rules = super::Rules::new(RULES);
            let args = ["--config", rules.path().to_str().unwrap()];
            let t = match open_files {
                Some(files) => {
                    let limit = format!("--nofile={files}");
                    Turnstile::start_under(&["prlimit", &limit, "--"], &args, &[]).await
                }
                None => Turnstile::start_with(&args, &[]).await,
            };
            let started = Instant::now();
            let held = flood(&t, 2, addresses, per_address, flooding).await;
            eprintln!("{row}: {} connected in {:?}", held.len(), started.elapsed());
            until_seen(&t, usize::from(addresses) * per_address).await;
            let flooded_in = started.elapsed();
            let closed_by_flood = grpc_metric(&t, "closed_to_make_room").await;
            let mut clients = Vec::new();
            for attempt in 1..=3 {
                let (took, client) = fresh_call(&t)
                    .await
                    .unwrap_or_else(|e| panic!("{row}: call {attempt} during the flood: {e}"));
                eprintln!("{row}: call {attempt} answered in {took:?}");
                clients.push(client);
            }
            let open = grpc_metric(&t, "open").await;
            let closed = grpc_metric(&t, "closed_to_make_room").await;
            drop(held);
            let (took, _) = fresh_call(&t)
                .await
                .unwrap_or_else(|e| panic!("{row}: the call right after the flood: {e}"));
            eprintln!(
                "{row}: flooded in {flooded_in:?}, then {open} open, {closed_by_flood} closed \
                 to make room by the flood, {closed} with the client's; after the flood \
                 answered in {took:?}"
            );
            // Ten addresses fill the port: each of the client's connections took a place.
            if addresses > 1 {
                assert!(
                    closed >= closed_by_flood + 3.0,
                    "{row}: {closed_by_flood}, then {closed} closed to make room"
                );
            }
        }
    }

    #[tokio::test]
    async fn a_flood_never_keeps_a_new_client_out_at_the_default_limits() {
        use Flooding::*;
        flooded(&[
            (None, 1, 1_200, IdleTcp),
            (None, 1, 1_200, IdleAfterPreface),
            (None, 10, 1_000, IdleTcp),
            (None, 10, 1_000, IdleAfterPreface),
        ])
        .await;
    }

    #[tokio::test]
    async fn a_flood_never_keeps_a_new_client_out_under_a_low_open_files_limit() {
        use Flooding::*;
        flooded(&[
            (Some(256), 1, 400, IdleTcp),
            (Some(256), 1, 400, IdleAfterPreface),
            (Some(256), 10, 40, IdleTcp),
            (Some(256), 10, 40, IdleAfterPreface),
        ])
        .await;
    }

    /// What keeps an Envoy-like client's connection busy.
    #[derive(Clone, Copy, Debug)]
    enum InFlight {
        /// A long RLQS stream.
        Stream,
        /// A ShouldRateLimit call held at a frozen Redis.
        FrozenBackend,
    }

    /// An Envoy-like client (127.0.0.2) among the biggest holders of a full port: of its
    /// four connections, the two oldest each hold a call in flight, the other two are idle.
    /// Twelve newcomers from addresses of their own each get their connection and call at
    /// the first try, each by closing a spare connection (a flooder's, Envoy's idle ones,
    /// then earlier newcomers'), and Envoy's calls are never cut: a stream ends cleanly
    /// when Envoy ends it, a held call is answered once Redis thaws. A cap of 8 gives each
    /// peer 4.
    #[tokio::test]
    async fn a_connection_with_a_call_in_flight_is_never_closed_to_make_room() {
        use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaUsageReports;
        use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
        use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;

        use crate::support::redis::RedisServer;

        for in_flight in [InFlight::Stream, InFlight::FrozenBackend] {
            let redis = matches!(in_flight, InFlight::FrozenBackend).then(RedisServer::start);
            let url = redis.as_ref().map(RedisServer::url).unwrap_or_default();
            let mut args = vec!["--grpc-max-connections", "8"];
            if redis.is_some() {
                // Calls wait for the frozen Redis as long as the test needs; a peer has two
                // in flight at most, which tells when both are.
                args.extend([
                    "--backend",
                    "redis",
                    "--redis-url",
                    &url,
                    "--redis-timeout",
                    "20s",
                    "--request-timeout",
                    "20s",
                    "--max-in-flight-per-peer",
                    "2",
                ]);
            }
            let (_rules, t) = start(&args).await;
            let envoy = loopback(2);
            let mut busy = Vec::new();
            for _ in 0..2 {
                busy.push(channel_from(&t, envoy).await.expect("connect"));
            }
            let mut idle = Vec::new();
            for _ in 0..2 {
                let mut c = client_from(&t, envoy).await.expect("connect");
                decide(&mut c).await.expect("a call");
                idle.push(c);
            }
            let mut streams = Vec::new();
            let mut held = Vec::new();
            match &redis {
                None => {
                    for channel in busy {
                        let (reports, rx) =
                            tokio::sync::mpsc::channel::<RateLimitQuotaUsageReports>(1);
                        let outbound = futures_util::stream::unfold(rx, |mut rx| async move {
                            rx.recv().await.map(|report| (report, rx))
                        });
                        let answers = RateLimitQuotaServiceClient::new(channel)
                            .stream_rate_limit_quotas(outbound)
                            .await
                            .expect("an RLQS stream")
                            .into_inner();
                        streams.push((reports, answers));
                    }
                }
                Some(redis) => {
                    redis.freeze();
                    for channel in busy {
                        let call = request("test", vec![descriptor(&[("wide", "held")])]);
                        held.push(tokio::spawn(async move {
                            RateLimitServiceClient::new(channel)
                                .should_rate_limit(call)
                                .await
                        }));
                    }
                    // Both are in flight once Envoy's next call is refused for its share.
                    let deadline = Instant::now() + Duration::from_secs(5);
                    while decide(&mut idle[0]).await.map_err(|e| e.code())
                        != Err(tonic::Code::ResourceExhausted)
                    {
                        assert!(Instant::now() < deadline, "the held calls never arrived");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
            let _flood = flood(&t, 3, 1, 4, Flooding::IdleAfterPreface).await;
            until_grpc_open(&t, 8.0).await;
            let mut newcomers = Vec::new();
            for n in 0..12 {
                let client = async {
                    let mut client = client_from(&t, loopback(10 + n)).await?;
                    decide(&mut client).await?;
                    Ok::<_, Box<dyn std::error::Error>>(client)
                }
                .await
                .unwrap_or_else(|e| panic!("{in_flight:?}: newcomer {n}: {e:?}"));
                newcomers.push(client);
            }
            assert_eq!(
                t.metric("turnstile_connections_closed_to_make_room{listener=\"grpc\"}")
                    .await,
                Some(12.0),
                "{in_flight:?}"
            );
            for (n, (reports, mut answers)) in streams.into_iter().enumerate() {
                drop(reports);
                let end = tokio::time::timeout(Duration::from_secs(3), answers.message()).await;
                assert!(
                    matches!(end, Ok(Ok(None))),
                    "Envoy's stream {n} did not end cleanly: {end:?}"
                );
            }
            if let Some(redis) = &redis {
                redis.thaw();
            }
            for (n, call) in held.into_iter().enumerate() {
                let answer = tokio::time::timeout(Duration::from_secs(5), call)
                    .await
                    .unwrap_or_else(|_| panic!("Envoy's held call {n}: no answer in 5 s"))
                    .expect("the call's task");
                let code = answer.map(|a| a.into_inner().overall_code);
                assert_eq!(
                    code.map_err(|e| e.code()),
                    Ok(Code::Ok as i32),
                    "Envoy's held call {n}"
                );
            }
        }
    }

    #[tokio::test]
    async fn the_admin_port_cuts_off_slow_and_silent_clients() {
        let (_rules, t) = start(&["--http-read-timeout", "1s"]).await;
        // (client, what it sends, then trickles a byte at a time, answer it gets first)
        let rows: [(&str, &[u8], &[u8], &str); 4] = [
            ("silent", b"", b"", ""),
            (
                "headers that never end",
                b"GET /healthcheck HTTP/1.1\r\nHost: x\r\nX-Slow: ",
                b"a",
                "",
            ),
            (
                "a body that never comes",
                b"POST /json HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"domain\"",
                b"",
                "HTTP/1.1 408",
            ),
            (
                "idle after an answer",
                b"GET /healthcheck HTTP/1.1\r\nHost: x\r\n\r\n",
                b"",
                "HTTP/1.1 200",
            ),
        ];
        let closed =
            futures_util::future::join_all(rows.iter().map(|(_, first, trickle, _)| async {
                closed_after(
                    connect(t.http).await,
                    first,
                    trickle,
                    Duration::from_secs(10),
                )
                .await
            }))
            .await;
        for ((name, _, _, answer), closed) in rows.iter().zip(closed) {
            let (after, received) =
                closed.unwrap_or_else(|| panic!("{name}: still open after 10 s"));
            assert!(
                after >= Duration::from_millis(900),
                "{name}: closed after {after:?}"
            );
            assert!(
                received.starts_with(answer),
                "{name}: answered {received:?}"
            );
        }
        assert_eq!(t.http_get("/healthcheck").await.unwrap().0, 200);
    }

    #[tokio::test]
    async fn an_admin_client_that_stops_reading_is_cut_off() {
        // /rlconfig of these rules (about 8 MB) is more than the sockets' buffers hold.
        let value = "v".repeat(900);
        let mut yaml = String::from("domain: big\ndescriptors:\n");
        for i in 0..8_000 {
            yaml += &format!(
                "  - key: k{i}\n    value: {value}\n    rate_limit: {{unit: hour, requests_per_unit: 1}}\n"
            );
        }
        let rules = Rules::new(&yaml);
        let t = Turnstile::start(rules.path(), &["--http-read-timeout", "1s"]).await;
        let mut deaf = connect(t.http).await;
        deaf.write_all(b"GET /rlconfig HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let asked = Instant::now();
        // Open admin connections: the deaf one and the one asking (and, for a moment, an
        // earlier request's that is still closing), until the deaf one is closed.
        let open = "turnstile_connections_open{listener=\"http\"}";
        let stuck = t.metric(open).await;
        assert!(
            stuck.is_some_and(|n| n >= 2.0),
            "the deaf client's answer is stuck: {stuck:?} open"
        );
        while t.metric(open).await != Some(1.0) {
            assert!(
                asked.elapsed() < Duration::from_secs(10),
                "still open after 10 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            asked.elapsed() >= Duration::from_millis(900),
            "{:?}",
            asked.elapsed()
        );
        drop(deaf);
    }

    /// User plus system CPU time of process `pid`, from /proc.
    fn cpu_time(pid: u32) -> Duration {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
        // The fields after the command name: state is the first, utime the 12th, stime the 13th.
        let fields: Vec<&str> = stat
            .rsplit_once(") ")
            .expect("stat format")
            .1
            .split(' ')
            .collect();
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        // SAFETY: sysconf only reads a system constant.
        let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        Duration::from_secs_f64(ticks as f64 / per_second)
    }

    /// CPU time process `pid` uses over three seconds: a few milliseconds when idle, a
    /// share of a core (even on a busy machine, hundreds of milliseconds) when spinning.
    async fn cpu_over_three_seconds(pid: u32) -> Duration {
        let before = cpu_time(pid);
        tokio::time::sleep(Duration::from_secs(3)).await;
        cpu_time(pid) - before
    }

    #[tokio::test]
    async fn accepting_past_the_open_files_limit_backs_off_instead_of_spinning() {
        let (_rules, t) = start(&[]).await;
        let mut envoy = client(&t).await;
        decide(&mut envoy).await.expect("a call before the limit");
        // Files taken by something else: the limit drops to just above what is open, far
        // below the connection caps computed at start-up, so accepting fails with EMFILE.
        let open = std::fs::read_dir(format!("/proc/{}/fd", t.pid()))
            .unwrap()
            .count();
        let limit = format!("--nofile={}", open + 4);
        let lowered = std::process::Command::new("prlimit")
            .args(["--pid", &t.pid().to_string(), &limit])
            .status()
            .expect("run prlimit");
        assert!(lowered.success());
        let mut flood = Vec::new();
        for _ in 0..40 {
            flood.push(connect(t.grpc).await);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let used = cpu_over_three_seconds(t.pid()).await;
        // Spinning takes a whole core (3 s); backing off took 110-120 ms on a slow host, so
        // the bound sits between, far from both.
        assert!(
            used < Duration::from_millis(600),
            "{used:?} of CPU in 3 s: spinning"
        );
        decide(&mut envoy)
            .await
            .expect("an open connection answers at the limit");
        drop(flood);
    }

    #[tokio::test]
    async fn at_the_open_files_limit_calls_and_health_still_answer_and_nothing_spins() {
        const OPEN_FILES: usize = 64;
        let rules = Rules::new(RULES);
        let limit = format!("--nofile={OPEN_FILES}");
        let t = Turnstile::start_under(
            &["prlimit", &limit, "--"],
            &[
                "--config",
                rules.path().to_str().unwrap(),
                "--grpc-handshake-timeout",
                "5s",
            ],
            &[],
        )
        .await;
        let mut envoy = client(&t).await;
        decide(&mut envoy).await.expect("a call before the flood");
        // More idle connections than the process may have files open.
        let mut flood = Vec::new();
        for _ in 0..OPEN_FILES + 40 {
            flood.push(connect(t.grpc).await);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let used = cpu_over_three_seconds(t.pid()).await;
        // Spinning takes a whole core (3 s); backing off took 110-120 ms on a slow host, so
        // the bound sits between, far from both.
        assert!(
            used < Duration::from_millis(600),
            "{used:?} of CPU in 3 s: spinning"
        );
        let started = Instant::now();
        decide(&mut envoy)
            .await
            .expect("an open connection answers during the flood");
        assert_eq!(t.http_get("/healthcheck").await.unwrap().0, 200);
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        // A new connection gets a slot once the silent ones have timed out.
        assert!(
            new_connection_answers_within(&t, Duration::from_secs(10)).await,
            "no new connection in 10 s"
        );
        let refused = t
            .metric("turnstile_connections_refused{listener=\"grpc\"}")
            .await;
        assert!(refused.unwrap_or(0.0) > 0.0, "refused {refused:?}");
        drop(flood);
    }
}

/// Set only in the child test process that `the_callers_environment_does_not_reach_turnstile`
/// starts: there, `environment_probe` runs with settings exported around it.
const ENV_PROBE: &str = "TURNSTILE_TEST_ENV_PROBE";

/// The harness starts turnstile with a cleared environment, so settings exported where the
/// tests run (as on a CI runner) cannot change what they test. This runs `environment_probe`
/// in a child test process whose environment has SHADOW_MODE (refusals would turn into OK)
/// and REDIS_URL (the Redis backend, on a port where nothing listens).
#[test]
fn the_callers_environment_does_not_reach_turnstile() {
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "environment_probe", "--test-threads", "1"])
        .env(ENV_PROBE, "1")
        .env("SHADOW_MODE", "true")
        .env("REDIS_URL", "redis://127.0.0.1:1")
        .output()
        .expect("run the probe");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{stdout}\n{stderr}"
    );
}

/// A memory-backend limit of 1 refuses its second call, whatever the environment says: run
/// directly, in the tests' own environment; run by the test above, in one that would turn
/// the refusal into OK (shadow mode) or an error (a Redis where nothing listens), had the
/// harness let it through.
#[tokio::test]
async fn environment_probe() {
    if std::env::var_os(ENV_PROBE).is_some() {
        assert_eq!(
            std::env::var("SHADOW_MODE").as_deref(),
            Ok("true"),
            "the probe runs in the environment it is to be immune to"
        );
    }
    let (_rules, t) = start(&[]).await;
    let one = || request("test", vec![descriptor(&[("narrow", "n")])]);
    assert_eq!(code(&t.call(one()).await.unwrap()), Code::Ok);
    assert_eq!(code(&t.call(one()).await.unwrap()), Code::OverLimit);
}

/// turnstile with the one rule the load generator's tests call: domain `gen`, key `k`,
/// `per_hour` calls an hour per value.
async fn for_the_generator(per_hour: u64) -> (Rules, Turnstile) {
    let rules = Rules::new(&format!(
        "domain: gen\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: {per_hour}}}\n"
    ));
    let t = Turnstile::start(rules.path(), &[]).await;
    (rules, t)
}

/// The load generator the benchmarks read (`turnstile-bench`) against the real binary: an
/// open loop sends each call of its timetable once, none late enough to go unsent, and a
/// closed loop capped by `--requests` sends exactly that many; each counts every answer by
/// its code (a limit of 400 an hour, 500 or 450 calls on one key), and every error by its
/// gRPC code (an empty domain, refused as invalid in a trailers-only answer).
#[tokio::test]
async fn the_load_generators_loops_send_each_call_once_and_count_the_answers() {
    use clap::Parser;
    let (_rules, t) = for_the_generator(400).await;
    // Each loop's counts are of one hour's counter.
    clear_of_end(HOUR, Duration::from_secs(60)).await;
    let target = t.grpc.to_string();
    struct Case {
        domain: &'static str,
        /// The loop: its own key value (so its own counter), and how it runs.
        load: &'static [&'static str],
        /// Calls, OK, OVER_LIMIT, errors, unsent.
        counts: (u64, u64, u64, u64, u64),
        errors: &'static [(&'static str, u64)],
    }
    const OPEN: &[&str] = &[
        "--value-prefix",
        "open",
        "--rate",
        "1000",
        "--duration",
        "500ms",
    ];
    let cases = [
        Case {
            domain: "gen",
            load: OPEN,
            counts: (500, 400, 100, 0, 0),
            errors: &[],
        },
        Case {
            domain: "",
            load: OPEN,
            counts: (500, 0, 0, 500, 0),
            errors: &[("InvalidArgument", 500)],
        },
        Case {
            domain: "gen",
            load: &[
                "--value-prefix",
                "closed",
                "--requests",
                "450",
                "--concurrency",
                "8",
                "--duration",
                "30s",
            ],
            counts: (450, 400, 50, 0, 0),
            errors: &[],
        },
    ];
    for Case {
        domain,
        load,
        counts,
        errors,
    } in cases
    {
        let common = [
            "turnstile-bench",
            "--target",
            &target,
            "--domain",
            domain,
            "--key",
            "k",
            "--keys",
            "1",
            "--warmup",
            "0s",
            "--threads",
            "1",
        ];
        let args = turnstile_bench::Cli::parse_from(common.iter().chain(load)).args;
        let report = turnstile_bench::run(args).await.expect("the load runs");
        assert_eq!(
            (
                report.calls,
                report.ok,
                report.over_limit,
                report.errors_total(),
                report.unsent
            ),
            counts,
            "domain {domain:?}, {load:?}: {}",
            report.text()
        );
        let errors: std::collections::BTreeMap<String, u64> =
            errors.iter().map(|(k, n)| ((*k).to_owned(), *n)).collect();
        assert_eq!(
            report.errors,
            errors,
            "domain {domain:?}, {load:?}: {}",
            report.text()
        );
        // Answers are timed; errors are only counted.
        assert_eq!(
            report.latency_ms(0.5) > 0.0,
            report.ok + report.over_limit > 0,
            "{}",
            report.text()
        );
    }
}

/// The load generator tells the calls that a stalled service kept waiting for a place among
/// those in flight from the ones it released late itself. An open loop at 400/s with 4 in
/// flight, stalled for 500 ms: with turnstile stopped (SIGSTOP), about 200 calls fall due
/// while every place is taken, released on time; with the generator's own thread blocked
/// (this test's runtime has one), about 200 are released late. Either way every call is
/// answered. A busy host makes the generator late now and then by itself (85 calls of 400
/// in one CI run, beside the other tests): the stall is long enough to stand out of that, and
/// its calls must outnumber the others.
#[tokio::test]
async fn the_open_loop_tells_a_stalled_service_from_its_own_lateness() {
    use clap::Parser;
    let (_rules, t) = for_the_generator(1_000_000).await;
    let target = t.grpc.to_string();
    let stall = Duration::from_millis(500);
    // What stalls, and whether the calls that fall due meanwhile are released late (else
    // released on time, to wait for a place).
    let rows = [("service", false), ("generator", true)];
    for (stalled, stall_releases_late) in rows {
        let args = turnstile_bench::Cli::parse_from([
            "turnstile-bench",
            "--target",
            &target,
            "--domain",
            "gen",
            "--key",
            "k",
            "--value-prefix",
            stalled,
            "--rate",
            "400",
            "--duration",
            "1s",
            "--warmup",
            "0s",
            "--concurrency",
            "4",
            "--timeout",
            "10s",
        ])
        .args;
        let load = tokio::spawn(turnstile_bench::run(args));
        tokio::time::sleep(Duration::from_millis(300)).await;
        if stalled == "service" {
            signal(t.pid(), "STOP");
            tokio::time::sleep(stall).await;
            signal(t.pid(), "CONT");
        } else {
            // The runtime's one thread, which the generator's tasks run on, does nothing else.
            std::thread::sleep(stall);
        }
        let report = load.await.expect("the load's task").expect("the load runs");
        let text = report.text();
        assert_eq!(
            (
                report.calls,
                report.ok,
                report.errors_total(),
                report.unsent
            ),
            (400, 400, 0, 0),
            "{stalled}: {text}"
        );
        let (by_the_stall, other) = if stall_releases_late {
            (report.released_late, report.waited_for_place)
        } else {
            (report.waited_for_place, report.released_late)
        };
        assert!(
            by_the_stall >= 150 && other < by_the_stall,
            "{stalled}: {text}"
        );
    }
}

const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Call ShouldRateLimit with `body` as it is, over a connection of its own.
async fn raw_should_rate_limit(t: &Turnstile, grpc_timeout: &str, body: RawBody) -> tonic::Status {
    let (send, driver) = raw_connection(t).await;
    let answer = raw_call(send, SHOULD_RATE_LIMIT, grpc_timeout, body).await;
    driver.abort();
    answer
}

/// Streams whose message never comes hold no place among the calls in flight: one connection
/// opens 16 of them against `--max-in-flight 4`, and another client's call is still decided,
/// not refused RESOURCE_EXHAUSTED. The server advertises 8 streams per connection, so the
/// client holds back half of them until the first 8 are cut for want of their message
/// (within the 1 s request timeout): all are answered DEADLINE_EXCEEDED, in two rounds.
#[tokio::test]
async fn stalled_streams_hold_no_place_among_the_calls_in_flight() {
    use prost::Message;
    let (_rules, t) = start(&[
        "--max-in-flight",
        "4",
        "--grpc-max-streams",
        "8",
        "--request-timeout",
        "1s",
    ])
    .await;
    let message = request("test", vec![descriptor(&[("minute", "stalled")])]).encode_to_vec();
    let (send, driver) = raw_connection(&t).await;
    // Let the server's SETTINGS (its cap on streams) arrive before the streams open.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let opened = std::time::Instant::now();
    let stalled: Vec<_> = (0..16)
        .map(|_| {
            let body = RawBody {
                data: Some(framed(0, message.len(), b"")),
                stall: true,
                ..Default::default()
            };
            let send = send.clone();
            tokio::spawn(async move {
                let status = raw_call(send, SHOULD_RATE_LIMIT, "1H", body).await;
                (status.code(), opened.elapsed())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let whole = RawBody {
        data: Some(framed(0, message.len(), &message)),
        stall: false,
        ..Default::default()
    };
    let decided = raw_should_rate_limit(&t, "5S", whole).await;
    assert_eq!(decided.code(), tonic::Code::Ok, "{decided:?}");
    let mut cut = Vec::new();
    for stream in stalled {
        let (code, at) = stream.await.unwrap();
        assert_eq!(
            code,
            tonic::Code::DeadlineExceeded,
            "a stalled stream at {at:?}"
        );
        cut.push(at);
    }
    driver.abort();
    cut.sort();
    assert!(
        cut[8] - cut[7] > Duration::from_millis(400),
        "8 streams open at a time, cut in two rounds: {cut:?}"
    );
}

/// The gRPC edge reads ShouldRateLimit's framing itself: each way a body can be wrong gets
/// its own clear status, none counts anything, and a well-framed call still decides.
#[tokio::test]
async fn ill_framed_calls_get_a_clear_status_and_count_nothing() {
    use prost::Message;
    let (_rules, t) = start(&["--max-message-bytes", "4096", "--request-timeout", "500ms"]).await;
    clear_of_end(MINUTE, CALLS_SPAN).await;
    let message = request("test", vec![descriptor(&[("minute", "framing")])]).encode_to_vec();
    let whole = |data| RawBody {
        data: Some(data),
        stall: false,
        ..Default::default()
    };
    let rows: Vec<(&str, RawBody, tonic::Code, &str)> = vec![
        (
            "no body",
            RawBody {
                data: None,
                stall: false,
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "ended after 0 bytes",
        ),
        (
            "half a prefix",
            whole(framed(0, 9, b"")[..3].to_vec().into()),
            tonic::Code::InvalidArgument,
            "ended after 3 bytes",
        ),
        (
            "half a message",
            whole(framed(0, message.len(), &message[..4])),
            tonic::Code::InvalidArgument,
            "before its message",
        ),
        (
            "compressed",
            whole(framed(1, message.len(), &message)),
            tonic::Code::Unimplemented,
            "compressed requests",
        ),
        (
            "an unknown flag",
            whole(framed(9, message.len(), &message)),
            tonic::Code::InvalidArgument,
            "not 9",
        ),
        (
            "too long",
            whole(framed(0, 5000, b"")),
            tonic::Code::OutOfRange,
            "5000 bytes, over the limit of 4096",
        ),
        (
            "not protobuf",
            whole(framed(0, 3, b"\xff\xff\xff")),
            tonic::Code::InvalidArgument,
            "not a RateLimitRequest",
        ),
        (
            "two messages",
            whole(
                [
                    framed(0, message.len(), &message),
                    framed(0, message.len(), &message),
                ]
                .concat()
                .into(),
            ),
            tonic::Code::InvalidArgument,
            "carries one message",
        ),
        (
            "a second message in a frame of its own",
            RawBody {
                data: Some(framed(0, message.len(), &message)),
                later: Some(framed(0, message.len(), &message)),
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "carries one message",
        ),
        (
            "a message, then a stream left open",
            RawBody {
                data: Some(framed(0, message.len(), &message)),
                stall: true,
                ..Default::default()
            },
            tonic::Code::DeadlineExceeded,
            "did not end",
        ),
        (
            "a stalled body",
            RawBody {
                data: Some(framed(0, message.len(), b"")),
                stall: true,
                ..Default::default()
            },
            tonic::Code::DeadlineExceeded,
            "did not arrive",
        ),
    ];
    for (name, body, code, message) in rows {
        let got = raw_should_rate_limit(&t, "300m", body).await;
        assert_eq!(got.code(), code, "{name}: {got:?}");
        let text = got.message();
        assert!(text.contains(message), "{name}: {text:?} lacks {message:?}");
    }
    // A caller that says it waits an hour does not hold a stalled call open that long: the
    // request timeout bounds every call.
    let stalled = RawBody {
        data: Some(framed(0, message.len(), b"")),
        stall: true,
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let status = raw_should_rate_limit(&t, "1H", stalled).await;
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    let status = raw_should_rate_limit(&t, "300m", whole(framed(0, message.len(), &message))).await;
    assert_eq!(status.code(), tonic::Code::Ok, "a well-framed call decides");
    let after = t
        .call(request("test", vec![descriptor(&[("minute", "framing")])]))
        .await
        .unwrap();
    assert_eq!(
        remaining(&after),
        [1],
        "only the well-framed call was counted"
    );
}

/// PROMETHEUS_MAPPER_YAML decides the reference's series on every port that serves them, as
/// the reference's statsd_exporter mapping does; a file that does not load stops the start.
#[tokio::test]
async fn a_mapper_file_shapes_the_reference_series_and_a_bad_one_stops_the_start() {
    use support::turnstile::free_port;
    let rules = Rules::new(
        "domain: edge\ndescriptors:\n  - key: plan\n    value: free\n    rate_limit: {unit: hour, requests_per_unit: 10}\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 10}\n",
    );
    // Beside the rules' directory, not in it: every file there is rules.
    let files = Rules::new("");
    files.write(
        "mapper.yaml",
        r#"
mappings:
- match: ratelimit.service.rate_limit.*.*.within_limit
  action: drop
  name: dropped
- match: 'ratelimit\.service\.rate_limit\.([^.]+)\.(.+)\.total_hits'
  match_type: regex
  name: rl_hits
  labels: {domain: $1, path: $2}
- match: ratelimit_server.*.response_time
  name: rpc_ms
  observer_type: histogram
  buckets: [60000]
  labels: {method: $1}
"#,
    );
    let mapper = files.path().join("mapper.yaml");
    let mapper = mapper.to_str().unwrap();
    let prometheus = format!("127.0.0.1:{}", free_port());
    let t = Turnstile::start_with(
        &[
            "--config",
            rules.path().to_str().unwrap(),
            "--use-prometheus",
        ],
        &[
            ("PROMETHEUS_ADDR", prometheus.as_str()),
            ("PROMETHEUS_MAPPER_YAML", mapper),
        ],
    )
    .await;
    for call in [
        request("edge", vec![descriptor(&[("plan", "free")])]),
        request(
            "edge",
            vec![descriptor(&[("plan", "free"), ("user", "u1")])],
        ),
        request("elsewhere", vec![descriptor(&[("plan", "free")])]),
    ] {
        t.call(call).await.unwrap();
    }
    // The health checks the harness makes are calls too; their count is not this test's,
    // nor are the process's series.
    let reference = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| {
                !l.is_empty()
                    && !l.starts_with('#')
                    && !l.starts_with("turnstile_")
                    && !l.starts_with("process_")
            })
            .filter(|l| !l.contains("Check") && !l.starts_with("rpc_ms_sum"))
            .map(str::to_owned)
            .collect()
    };
    let expected = [
        "ratelimit_server_ShouldRateLimit_total_requests 3",
        "ratelimit_service_config_load_success 1",
        "ratelimit_service_rate_limit_edge_plan_free_user_within_limit 1",
        "ratelimit_service_rate_limit_elsewhere_domain_not_found 1",
        "rl_hits{domain=\"edge\",path=\"plan_free\"} 1",
        "rl_hits{domain=\"edge\",path=\"plan_free.user\"} 1",
        "rpc_ms_bucket{method=\"ShouldRateLimit\",le=\"60000\"} 3",
        "rpc_ms_bucket{method=\"ShouldRateLimit\",le=\"+Inf\"} 3",
        "rpc_ms_count{method=\"ShouldRateLimit\"} 3",
    ];
    let (status, main) = t.http_get("/metrics").await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(reference(&main), expected, "{main}");
    let (status, own) =
        support::turnstile::http(prometheus.parse().unwrap(), "GET", "/metrics", "")
            .await
            .unwrap();
    assert_eq!(status, 200);
    assert_eq!(reference(&own), expected, "{own}");
    assert!(main.contains("# TYPE rpc_ms histogram"), "{main}");

    files.write("mapper.yaml", "mappings:\n- {match: 'a.b*', name: x}\n");
    let mut serve = Command::new(env!("CARGO_BIN_EXE_turnstile"))
        .args([
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
        ])
        .arg("--config")
        .arg(rules.path())
        .env("PROMETHEUS_MAPPER_YAML", mapper)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = serve.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            serve.kill().unwrap();
            serve.wait().unwrap();
            panic!("serve started with a mapper file that does not load");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut serve.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!status.success());
    assert!(
        stderr.contains("PROMETHEUS_MAPPER_YAML") && stderr.contains("invalid match: a.b*"),
        "{stderr}"
    );
}
