//! The reference's answers where users see them, as one table both backends are held to
//! (tests/core.rs runs it on memory, tests/redis.rs on Redis with its over-limit cache).
//! They differ in one documented place: a request the over-limit cache refuses is answered
//! without Redis (an outage cannot turn that refusal into an error), so its other
//! descriptors are not asked and report their limit untouched.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;

use super::turnstile::{Turnstile, descriptor, request};

/// Daily limits, so no window ends while the table runs.
pub const RULES: &str = r#"
domain: ref
descriptors:
  - key: named
    rate_limit: {name: per-day, unit: day, requests_per_unit: 3}
  - key: plain
    rate_limit: {unit: day, requests_per_unit: 3}
  - key: wide
    rate_limit: {unit: day, requests_per_unit: 10}
  - key: narrow
    rate_limit: {unit: day, requests_per_unit: 1}
"#;

/// One status as a client sees it: code, `limit_remaining`, `current_limit.name` (None: no
/// `current_limit`).
type Status = (Code, u32, Option<&'static str>);

/// A request, the overall code expected and the statuses expected.
type Step = (RateLimitRequest, Code, Vec<Status>);

fn call(domain: &str, entries: &[(&'static str, &'static str)]) -> RateLimitRequest {
    request(domain, entries.iter().map(|e| descriptor(&[*e])).collect())
}

fn overriding(mut r: RateLimitRequest, requests_per_unit: u32) -> RateLimitRequest {
    for d in &mut r.descriptors {
        d.limit = Some(RateLimitOverride {
            requests_per_unit,
            unit: Unit::Day as i32,
        });
    }
    r
}

/// Rows: what they show, then requests in order with the overall code and statuses expected.
/// `cached`: an over-limit cache fronts the backend (Redis).
fn rows(cached: bool) -> Vec<(&'static str, Vec<Step>)> {
    use Code::{Ok, OverLimit};
    let named = Some("per-day");
    let unnamed = Some("");
    let twice = || call("ref", &[("named", "twice"), ("named", "twice")]);
    let both = || call("ref", &[("wide", "r"), ("narrow", "r")]);
    vec![
        (
            "the same descriptor twice is judged in order; a refused request charges neither",
            vec![
                (twice(), Ok, vec![(Ok, 2, named), (Ok, 1, named)]),
                (
                    twice(),
                    OverLimit,
                    vec![(Ok, 0, named), (OverLimit, 0, named)],
                ),
                (call("ref", &[("named", "twice")]), Ok, vec![(Ok, 0, named)]),
            ],
        ),
        (
            "current_limit.name is the YAML name, or empty (never the rule's path)",
            vec![(call("ref", &[("plain", "n")]), Ok, vec![(Ok, 2, unnamed)])],
        ),
        (
            "an override with the rule's unit counts on the rule's counter",
            vec![
                (
                    overriding(call("ref", &[("plain", "o")]), 10),
                    Ok,
                    vec![(Ok, 9, unnamed)],
                ),
                (call("ref", &[("plain", "o")]), Ok, vec![(Ok, 1, unnamed)]),
            ],
        ),
        (
            "an override on an unknown domain is ignored",
            vec![
                (
                    overriding(call("elsewhere", &[("plain", "x")]), 1),
                    Ok,
                    vec![(Ok, 0, None)],
                ),
                (
                    overriding(call("elsewhere", &[("plain", "x")]), 1),
                    Ok,
                    vec![(Ok, 0, None)],
                ),
            ],
        ),
        (
            "a descriptor not refused in a refused request reports what would remain had it \
             been charged (the over-limit cache, on Redis, answers the third without Redis: \
             its other descriptor untouched)",
            vec![
                (both(), Ok, vec![(Ok, 9, unnamed), (Ok, 0, unnamed)]),
                (
                    both(),
                    OverLimit,
                    vec![(Ok, 8, unnamed), (OverLimit, 0, unnamed)],
                ),
                (
                    both(),
                    OverLimit,
                    vec![
                        (Ok, if cached { 10 } else { 8 }, unnamed),
                        (OverLimit, 0, unnamed),
                    ],
                ),
                (call("ref", &[("wide", "r")]), Ok, vec![(Ok, 8, unnamed)]),
            ],
        ),
    ]
}

/// Run every row against `t`, started on [`RULES`]; `cached` as for [`rows`].
pub async fn check(t: &Turnstile, cached: bool) {
    for (what, steps) in rows(cached) {
        for (n, (req, overall, expected)) in steps.into_iter().enumerate() {
            let r = t.call(req).await.expect("call");
            let seen: Vec<(Code, u32, Option<&str>)> = r
                .statuses
                .iter()
                .map(|s| {
                    (
                        Code::try_from(s.code).expect("a code"),
                        s.limit_remaining,
                        s.current_limit.as_ref().map(|l| l.name.as_str()),
                    )
                })
                .collect();
            assert_eq!(
                (Code::try_from(r.overall_code).expect("a code"), seen),
                (overall, expected),
                "{what}: request #{n}"
            );
        }
    }
}
