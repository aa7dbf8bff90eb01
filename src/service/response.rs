//! The last step: from the plan and the backend's outcomes to a `RateLimitResponse`.
//!
//! One status per request descriptor, in order. `overall_code` is OVER_LIMIT when an
//! enforced status is over, or when quota statuses exist and all are over; shadow statuses
//! are reported as OK but keep their figures. Optional response headers describe the status
//! closest to its limit, in the reference's trio or the IETF draft's pair.
//!
//! Durations are exact to the millisecond, except in a refusal: Envoy cuts
//! `duration_until_reset` to whole seconds for `x-ratelimit-reset`, so a refusal's are rounded
//! up (at least 1 s) and the exact figure travels in the dynamic metadata (`reset_ms`).

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as ProtoUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Duration as ProtoDuration, ListValue, Struct, Value};

use crate::decision::limit::Limit;
use crate::decision::{Outcome, Role, request_refused};
use crate::service::plan::{Applied, Decision, Plan};

/// Which rate-limit headers the answer carries for Envoy to add to the client's response.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Headers {
    #[default]
    Off,
    /// The reference's `RateLimit-Limit`/`-Remaining`/`-Reset` (names configurable).
    Legacy {
        limit: String,
        remaining: String,
        reset: String,
    },
    /// draft-ietf-httpapi-ratelimit-headers: `RateLimit-Policy` and `RateLimit`.
    Ietf,
}

impl Headers {
    pub fn legacy_defaults() -> Headers {
        Headers::Legacy {
            limit: "RateLimit-Limit".into(),
            remaining: "RateLimit-Remaining".into(),
            reset: "RateLimit-Reset".into(),
        }
    }
}

/// Which answers carry `dynamic_metadata` naming the deciding rule (for Envoy's access logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MetadataOn {
    Off,
    /// Answers where a limit said no: OVER_LIMIT, or a refusal that shadow mode let through.
    /// Building and encoding the Struct was the largest part of an OK answer's own cost, and
    /// an OK answer has nothing to attribute.
    #[default]
    Refusals,
    All,
}

#[derive(Debug, Clone, Default)]
pub struct ResponseSettings {
    pub headers: Headers,
    pub metadata: MetadataOn,
    /// Attach the reference's `dynamic_metadata` instead (RESPONSE_DYNAMIC_METADATA): the
    /// request echoed, and the `metadata` of the rules that passed; the deciding rule's
    /// `rule`, `algorithm` and `outcome` are added beside it.
    pub reference_metadata: bool,
    /// Global shadow mode: an OVER_LIMIT answer is turned into OK (statuses keep theirs).
    pub global_shadow: bool,
}

/// The answer, and whether global shadow mode let an over-limit request through.
pub struct Built {
    pub response: RateLimitResponse,
    pub shadowed_globally: bool,
}

/// Microseconds, rounded up to whole milliseconds (a retry time must never be early).
fn proto_duration(micros: u64) -> ProtoDuration {
    let millis = micros.div_ceil(1_000);
    ProtoDuration {
        seconds: (millis / 1_000) as i64,
        nanos: ((millis % 1_000) * 1_000_000) as i32,
    }
}

fn seconds_up(d: &ProtoDuration) -> i64 {
    d.seconds + i64::from(d.nanos > 0)
}

/// A refused answer's retry time in whole seconds, at least one. Envoy turns
/// `duration_until_reset` into `x-ratelimit-reset` by dropping the fraction, so 0.4 s would
/// tell a refused client "0: now", and 1.5 s would say "1", when it would still be refused.
fn refusal_duration(d: &ProtoDuration) -> ProtoDuration {
    ProtoDuration {
        seconds: seconds_up(d).max(1),
        nanos: 0,
    }
}

fn millis(d: &ProtoDuration) -> f64 {
    d.seconds as f64 * 1e3 + f64::from(d.nanos / 1_000_000)
}

fn status(decision: &Decision<'_>, plan: &Plan<'_>, outcomes: &[Outcome]) -> DescriptorStatus {
    match decision {
        Decision::NoLimit => DescriptorStatus {
            code: Code::Ok.into(),
            ..Default::default()
        },
        Decision::Unlimited => DescriptorStatus {
            code: Code::Ok.into(),
            limit_remaining: u32::MAX,
            ..Default::default()
        },
        Decision::Limited(applied) => {
            let (limit, outcome) = plan.decisive(applied, outcomes);
            limited_status(applied, limit, outcome)
        }
    }
}

fn limited_status(applied: &Applied<'_>, limit: &Limit, outcome: &Outcome) -> DescriptorStatus {
    let over = !outcome.admitted && applied.role != Role::Shadow;
    DescriptorStatus {
        code: if over { Code::OverLimit } else { Code::Ok }.into(),
        current_limit: Some(RateLimit {
            name: applied.name.to_owned(),
            requests_per_unit: limit.requests_per_unit,
            unit: limit.unit.to_proto().into(),
        }),
        limit_remaining: outcome.remaining,
        duration_until_reset: Some(proto_duration(outcome.reset_after.as_micros() as u64)),
        ..Default::default()
    }
}

pub fn build(
    request: &RateLimitRequest,
    plan: &Plan<'_>,
    outcomes: &[Outcome],
    settings: &ResponseSettings,
) -> Built {
    let mut statuses: Vec<DescriptorStatus> = plan
        .decisions
        .iter()
        .map(|d| status(d, plan, outcomes))
        .collect();
    let over = request_refused(
        plan.decisions
            .iter()
            .filter_map(|d| match d {
                Decision::Limited(a) => Some(a),
                _ => None,
            })
            .flat_map(|a| a.hits().map(|i| (a.role, outcomes[i].admitted))),
    );
    let shadowed_globally = over && settings.global_shadow;
    let attach = match settings.metadata {
        MetadataOn::Off => false,
        MetadataOn::Refusals => any_refusal(plan, outcomes),
        MetadataOn::All => true,
    };
    // The metadata keeps the exact retry time (milliseconds) that a refusal's statuses lose.
    let dynamic_metadata = if settings.reference_metadata {
        Some(reference_metadata(request, plan, &statuses, outcomes))
    } else {
        attach.then(|| metadata(plan, &statuses, outcomes))
    };
    let refused = over && !shadowed_globally;
    if refused {
        // Whichever status Envoy picks for x-ratelimit-reset, it never says "now".
        for d in statuses
            .iter_mut()
            .filter_map(|s| s.duration_until_reset.as_mut())
        {
            *d = refusal_duration(d);
        }
    }
    let response_headers_to_add = headers(plan, &statuses, outcomes, &settings.headers);
    Built {
        response: RateLimitResponse {
            overall_code: if refused { Code::OverLimit } else { Code::Ok }.into(),
            statuses,
            response_headers_to_add,
            dynamic_metadata,
            ..Default::default()
        },
        shadowed_globally,
    }
}

/// Whether any limit refused its hit, even where shadow or quota mode admits the request.
fn any_refusal(plan: &Plan<'_>, outcomes: &[Outcome]) -> bool {
    plan.decisions.iter().any(|d| match d {
        Decision::Limited(a) => a.hits().any(|i| !outcomes[i].admitted),
        _ => false,
    })
}

/// The status the headers describe, as the reference picks it: the last enforced status
/// that is over, else the limited status with the fewest remaining (first wins ties).
fn headline<'p>(
    plan: &'p Plan<'_>,
    statuses: &[DescriptorStatus],
) -> Option<(usize, &'p Applied<'p>)> {
    let limited = || {
        plan.decisions
            .iter()
            .enumerate()
            .filter_map(|(i, d)| match d {
                Decision::Limited(a) => Some((i, a)),
                _ => None,
            })
    };
    limited()
        .rfind(|(i, a)| a.role != Role::Quota && statuses[*i].code == Code::OverLimit as i32)
        .or_else(|| {
            limited().reduce(|best, next| {
                if statuses[next.0].limit_remaining < statuses[best.0].limit_remaining {
                    next
                } else {
                    best
                }
            })
        })
}

fn header(key: &str, value: String) -> HeaderValue {
    HeaderValue {
        key: key.to_owned(),
        value,
        ..Default::default()
    }
}

fn headers(
    plan: &Plan<'_>,
    statuses: &[DescriptorStatus],
    outcomes: &[Outcome],
    style: &Headers,
) -> Vec<HeaderValue> {
    if *style == Headers::Off {
        return Vec::new();
    }
    let Some((index, applied)) = headline(plan, statuses) else {
        return Vec::new();
    };
    let status = &statuses[index];
    let (limit, _) = plan.decisive(applied, outcomes);
    let quota = limit.requests_per_unit;
    let remaining = status.limit_remaining;
    let reset = status.duration_until_reset.as_ref().map_or(0, seconds_up);
    match style {
        Headers::Off => Vec::new(),
        Headers::Legacy {
            limit: limit_name,
            remaining: remaining_name,
            reset: reset_name,
        } => vec![
            header(limit_name, quota.to_string()),
            header(remaining_name, remaining.to_string()),
            header(reset_name, reset.to_string()),
        ],
        Headers::Ietf => {
            let policy = if applied.name.is_empty() {
                "default"
            } else {
                applied.name
            };
            let window = limit.window;
            vec![
                header(
                    "RateLimit-Policy",
                    format!("\"{policy}\";q={quota};w={window}"),
                ),
                header("RateLimit", format!("\"{policy}\";r={remaining};t={reset}")),
            ]
        }
    }
}

/// What happened to one descriptor, in words for access logs.
fn outcome_name(decision: &Decision<'_>, outcomes: &[Outcome]) -> &'static str {
    match decision {
        Decision::NoLimit => "no_limit",
        Decision::Unlimited => "unlimited",
        Decision::Limited(a) if outcomes[a.decisive(outcomes)].admitted => "ok",
        Decision::Limited(a) => match a.role {
            Role::Enforce => "over_limit",
            Role::Shadow => "shadow_over_limit",
            Role::Quota => "quota_over_limit",
        },
    }
}

fn text(value: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(value.to_owned())),
    }
}

fn object(fields: impl IntoIterator<Item = (&'static str, Value)>) -> Struct {
    Struct {
        fields: fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
    }
}

/// `{rule, algorithm, outcome}` of the deciding descriptor (the one the headers describe)
/// at the top, for `%DYNAMIC_METADATA(envoy.filters.http.ratelimit:rule)%`, and the same
/// for every descriptor under `descriptors`.
fn metadata(plan: &Plan<'_>, statuses: &[DescriptorStatus], outcomes: &[Outcome]) -> Struct {
    let describe = |decision: &Decision<'_>, status: &DescriptorStatus| {
        let mut fields = vec![("outcome", text(outcome_name(decision, outcomes)))];
        if let Decision::Limited(a) = decision {
            fields.push(("rule", text(a.rule)));
            let (limit, _) = plan.decisive(a, outcomes);
            fields.push(("algorithm", text(limit.algorithm.name())));
        }
        if let Some(reset) = &status.duration_until_reset {
            fields.push((
                "reset_ms",
                Value {
                    kind: Some(Kind::NumberValue(millis(reset))),
                },
            ));
        }
        fields
    };
    let descriptors = plan
        .decisions
        .iter()
        .zip(statuses)
        .map(|(d, s)| Value {
            kind: Some(Kind::StructValue(object(describe(d, s)))),
        })
        .collect();
    let mut top = match headline(plan, statuses) {
        Some((index, _)) => describe(&plan.decisions[index], &statuses[index]),
        None => vec![("outcome", text("no_limit"))],
    };
    top.push((
        "descriptors",
        Value {
            kind: Some(Kind::ListValue(ListValue {
                values: descriptors,
            })),
        },
    ));
    object(top)
}

/// The reference's metadata: the request (domain, each descriptor's entries as `key=value`,
/// its override and addend), the request's addend, and the rules' `metadata` of every
/// descriptor that passed, merged (the first value wins). turnstile's `rule`, `algorithm`
/// and `outcome` of the deciding descriptor are added.
fn reference_metadata(
    request: &RateLimitRequest,
    plan: &Plan<'_>,
    statuses: &[DescriptorStatus],
    outcomes: &[Outcome],
) -> Struct {
    let number = |n: f64| Value {
        kind: Some(Kind::NumberValue(n)),
    };
    let descriptors = request
        .descriptors
        .iter()
        .map(|d| {
            let entries = d
                .entries
                .iter()
                .map(|e| text(&format!("{}={}", e.key, e.value)))
                .collect();
            let mut fields = vec![(
                "entries",
                Value {
                    kind: Some(Kind::ListValue(ListValue { values: entries })),
                },
            )];
            if let Some(limit) = &d.limit {
                let unit = ProtoUnit::try_from(limit.unit).map_or("UNKNOWN", |u| u.as_str_name());
                fields.push((
                    "limit",
                    text(&format!(
                        "requests_per_unit:{} unit:{unit}",
                        limit.requests_per_unit
                    )),
                ));
            }
            if let Some(addend) = &d.hits_addend {
                fields.push(("hitsAddend", number(addend.value as f64)));
            }
            Value {
                kind: Some(Kind::StructValue(object(fields))),
            }
        })
        .collect();
    let mut merged = serde_json::Map::new();
    for (decision, status) in plan.decisions.iter().zip(statuses) {
        if let Decision::Limited(a) = decision
            && status.code != Code::OverLimit as i32
            && let Some(serde_json::Value::Object(metadata)) = a.metadata
        {
            merge(&mut merged, metadata);
        }
    }
    let mut fields = vec![
        ("domain", text(&request.domain)),
        (
            "descriptors",
            Value {
                kind: Some(Kind::ListValue(ListValue {
                    values: descriptors,
                })),
            },
        ),
    ];
    if request.hits_addend != 0 {
        fields.push(("hitsAddend", number(f64::from(request.hits_addend))));
    }
    if !merged.is_empty() {
        fields.push(("metadata", proto_value(&serde_json::Value::Object(merged))));
    }
    let mut top = object(fields);
    let ours = metadata(plan, statuses, outcomes);
    for key in ["rule", "algorithm", "outcome", "reset_ms"] {
        if let Some(value) = ours.fields.get(key) {
            top.fields.insert(key.to_owned(), value.clone());
        }
    }
    top
}

/// Deep merge of `from` into `into`; what `into` has already wins.
fn merge(
    into: &mut serde_json::Map<String, serde_json::Value>,
    from: &serde_json::Map<String, serde_json::Value>,
) {
    for (key, value) in from {
        match (into.get_mut(key), value) {
            (Some(serde_json::Value::Object(a)), serde_json::Value::Object(b)) => merge(a, b),
            (Some(_), _) => {}
            (None, _) => {
                into.insert(key.clone(), value.clone());
            }
        }
    }
}

fn proto_value(value: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    let kind = match value {
        J::Null => Kind::NullValue(0),
        J::Bool(b) => Kind::BoolValue(*b),
        J::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
        J::String(s) => Kind::StringValue(s.clone()),
        J::Array(items) => Kind::ListValue(ListValue {
            values: items.iter().map(proto_value).collect(),
        }),
        J::Object(map) => Kind::StructValue(Struct {
            fields: map
                .iter()
                .map(|(k, v)| (k.clone(), proto_value(v)))
                .collect(),
        }),
    };
    Value { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_up_to_the_millisecond() {
        let d = proto_duration(1_500_001);
        assert_eq!((d.seconds, d.nanos), (1, 501_000_000));
        assert_eq!(seconds_up(&d), 2);
        let whole = proto_duration(58_000_000);
        assert_eq!(
            (whole.seconds, whole.nanos, seconds_up(&whole)),
            (58, 0, 58)
        );
    }

    #[test]
    fn a_refusal_says_whole_seconds_and_never_zero() {
        for (micros, seconds) in [
            (0, 1),
            (1, 1),
            (400_000, 1),
            (1_000_000, 1),
            (1_500_000, 2),
            (58_000_000, 58),
            (58_000_001, 59),
        ] {
            let d = refusal_duration(&proto_duration(micros));
            assert_eq!((d.seconds, d.nanos), (seconds, 0), "{micros} µs");
        }
        assert_eq!(millis(&proto_duration(1_500_001)), 1_501.0);
    }
}
