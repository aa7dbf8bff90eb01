//! The proto3 JSON form of `RateLimitRequest` and `RateLimitResponse`, for HTTP `/json`.
//!
//! Field names are accepted in both camelCase and snake_case, enums by name or number and
//! 64-bit integers as numbers or strings, as proto3 JSON parsers do; answers are camelCase
//! with default values left out. By hand because `envoy-types` has no serde: pbjson would
//! mean generating a second copy of the Envoy types for two messages.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, RateLimit};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use serde::Deserialize;
use serde_json::{Map, Value, json};

#[derive(Deserialize)]
#[serde(untagged)]
enum Number {
    Int(u64),
    Text(String),
}

impl Number {
    fn value(&self) -> Result<u64, String> {
        match self {
            Number::Int(n) => Ok(*n),
            Number::Text(t) => t.parse().map_err(|_| format!("not a number: {t:?}")),
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum UnitValue {
    Name(String),
    Number(i32),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonEntry {
    key: String,
    #[serde(default)]
    value: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonOverride {
    #[serde(alias = "requests_per_unit", rename = "requestsPerUnit", default)]
    requests_per_unit: u32,
    #[serde(default)]
    unit: Option<UnitValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonDescriptor {
    #[serde(default)]
    entries: Vec<JsonEntry>,
    #[serde(default)]
    limit: Option<JsonOverride>,
    #[serde(alias = "hits_addend", rename = "hitsAddend", default)]
    hits_addend: Option<Number>,
    #[serde(alias = "is_negative_hits", rename = "isNegativeHits", default)]
    is_negative_hits: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<JsonDescriptor>,
    #[serde(alias = "hits_addend", rename = "hitsAddend", default)]
    hits_addend: Option<Number>,
}

fn unit(value: Option<UnitValue>) -> Result<i32, String> {
    match value {
        None => Ok(Unit::Unknown.into()),
        Some(UnitValue::Number(n)) => Ok(n),
        Some(UnitValue::Name(name)) => Unit::from_str_name(&name)
            .map(Into::into)
            .ok_or_else(|| format!("unknown unit {name:?}")),
    }
}

/// Parse a `/json` body.
pub fn parse_request(body: &[u8]) -> Result<RateLimitRequest, String> {
    let request: JsonRequest = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let hits_addend = match request.hits_addend {
        Some(n) => u32::try_from(n.value()?).map_err(|_| "hitsAddend is above 2^32-1")?,
        None => 0,
    };
    let descriptors = request
        .descriptors
        .into_iter()
        .map(|d| {
            Ok(RateLimitDescriptor {
                entries: d
                    .entries
                    .into_iter()
                    .map(|e| Entry {
                        key: e.key,
                        value: e.value,
                    })
                    .collect(),
                limit: d
                    .limit
                    .map(|o| {
                        Ok::<_, String>(RateLimitOverride {
                            requests_per_unit: o.requests_per_unit,
                            unit: unit(o.unit)?,
                        })
                    })
                    .transpose()?,
                hits_addend: d
                    .hits_addend
                    .map(|n| n.value().map(|value| UInt64Value { value }))
                    .transpose()?,
                is_negative_hits: d.is_negative_hits,
            })
        })
        .collect::<Result<_, String>>()?;
    Ok(RateLimitRequest {
        domain: request.domain,
        descriptors,
        hits_addend,
    })
}

/// The HTTP status of a failed call: 400 only for a request at fault (`INVALID_ARGUMENT`);
/// anything else is the service's failure (the backend down or its circuit open), 503.
pub fn error_status(status: &tonic::Status) -> http::StatusCode {
    match status.code() {
        tonic::Code::InvalidArgument => http::StatusCode::BAD_REQUEST,
        _ => http::StatusCode::SERVICE_UNAVAILABLE,
    }
}

fn code_name(code: i32) -> &'static str {
    Code::try_from(code).map_or("UNKNOWN", |c| c.as_str_name())
}

fn limit_json(limit: &RateLimit) -> Value {
    let mut out = Map::new();
    if !limit.name.is_empty() {
        out.insert("name".into(), json!(limit.name));
    }
    if limit.requests_per_unit != 0 {
        out.insert("requestsPerUnit".into(), json!(limit.requests_per_unit));
    }
    let unit = Unit::try_from(limit.unit).map_or("UNKNOWN", |u| u.as_str_name());
    out.insert("unit".into(), json!(unit));
    Value::Object(out)
}

/// The camelCase proto3 JSON of an answer.
pub fn response_json(response: &RateLimitResponse) -> Value {
    let statuses: Vec<Value> = response
        .statuses
        .iter()
        .map(|s| {
            let mut out = Map::new();
            out.insert("code".into(), json!(code_name(s.code)));
            if let Some(limit) = &s.current_limit {
                out.insert("currentLimit".into(), limit_json(limit));
            }
            if s.limit_remaining != 0 {
                out.insert("limitRemaining".into(), json!(s.limit_remaining));
            }
            if let Some(d) = &s.duration_until_reset {
                let text = if d.nanos == 0 {
                    format!("{}s", d.seconds)
                } else {
                    format!("{}.{:03}s", d.seconds, d.nanos / 1_000_000)
                };
                out.insert("durationUntilReset".into(), json!(text));
            }
            Value::Object(out)
        })
        .collect();
    let mut out = Map::new();
    out.insert(
        "overallCode".into(),
        json!(code_name(response.overall_code)),
    );
    if !statuses.is_empty() {
        out.insert("statuses".into(), Value::Array(statuses));
    }
    let headers: Vec<Value> = response
        .response_headers_to_add
        .iter()
        .map(|h| json!({"key": h.key, "value": h.value}))
        .collect();
    if !headers.is_empty() {
        out.insert("responseHeadersToAdd".into(), Value::Array(headers));
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_spellings_and_string_numbers_parse() {
        let camel =
            br#"{"domain":"d","hitsAddend":2,"descriptors":[{"entries":[{"key":"k","value":"v"}],
            "limit":{"requestsPerUnit":5,"unit":"MINUTE"},"hitsAddend":"3"}]}"#;
        let snake =
            br#"{"domain":"d","hits_addend":2,"descriptors":[{"entries":[{"key":"k","value":"v"}],
            "limit":{"requests_per_unit":5,"unit":2},"hits_addend":3}]}"#;
        let a = parse_request(camel).unwrap();
        assert_eq!(a, parse_request(snake).unwrap());
        assert_eq!(a.hits_addend, 2);
        assert_eq!(a.descriptors[0].hits_addend, Some(UInt64Value { value: 3 }));
        assert_eq!(
            a.descriptors[0].limit.as_ref().unwrap().unit,
            Unit::Minute as i32
        );
    }

    #[test]
    fn only_a_request_at_fault_is_a_bad_request() {
        for (code, http) in [
            (tonic::Code::InvalidArgument, 400),
            (tonic::Code::Unavailable, 503),
            (tonic::Code::DeadlineExceeded, 503),
            (tonic::Code::ResourceExhausted, 503),
        ] {
            let status = tonic::Status::new(code, "backend circuit open");
            assert_eq!(error_status(&status).as_u16(), http, "{code:?}");
        }
    }

    #[test]
    fn bad_bodies_are_errors() {
        assert!(parse_request(b"").is_err());
        assert!(parse_request(b"{\"domain\": 5}").is_err());
        assert!(parse_request(b"{\"domian\": \"x\"}").is_err());
        assert!(parse_request(br#"{"descriptors":[{"limit":{"unit":"FORTNIGHT"}}]}"#).is_err());
    }
}
