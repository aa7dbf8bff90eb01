//! The first step of every call: turn a `RateLimitRequest` into a `CheckRequest` that is
//! known to be well formed and bounded, or refuse it with `INVALID_ARGUMENT` and a message,
//! so nothing downstream can panic or grow on input.
//!
//! To Envoy an error is not a refusal (by default it lets the request through), so
//! `INVALID_ARGUMENT` is kept for what Envoy never sends (an empty domain or key, no
//! descriptors or entries, an unknown override unit) and for sizes past `Bounds`, whose
//! defaults are far above Envoy's. An override of `requests_per_unit: 0` is answered
//! `OVER_LIMIT`, as the reference does; one with unit `UNKNOWN` is ignored.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as ProtoUnit;

use crate::decision::limit::Unit;

/// Size bounds on requests. Generous for Envoy's real descriptors, small enough that one
/// request cannot cost much memory or CPU. Every key in a backend and every request-driven
/// metric label is built from one descriptor (and the domain), so `max_descriptor_bytes`
/// also bounds what one key or series costs, in turnstile and in Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub max_descriptors: usize,
    pub max_entries: usize,
    /// The domain's length, and a descriptor's keys and values added together.
    pub max_descriptor_bytes: usize,
}

/// Default for `Bounds::max_descriptor_bytes`.
pub const DEFAULT_MAX_DESCRIPTOR_BYTES: usize = 4096;

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            max_descriptors: 64,
            max_entries: 32,
            max_descriptor_bytes: DEFAULT_MAX_DESCRIPTOR_BYTES,
        }
    }
}

/// A request-supplied limit (`descriptor.limit`), validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Override {
    pub requests_per_unit: u32,
    pub unit: Unit,
}

/// One validated descriptor; it borrows the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor<'r> {
    pub entries: Vec<(&'r str, &'r str)>,
    pub limit_override: Option<Override>,
    /// Units this descriptor costs; 0 reads without charging.
    pub hits: u64,
    /// Envoy's negative hits (`is_negative_hits`): a concurrency limit's permit is given back;
    /// other limits only read.
    pub release: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckRequest<'r> {
    pub domain: &'r str,
    pub descriptors: Vec<Descriptor<'r>>,
}

/// Why a request is refused; the text is the gRPC status message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidRequest(pub String);

fn check_len(what: impl FnOnce() -> String, len: usize, max: usize) -> Result<(), InvalidRequest> {
    if len > max {
        return Err(InvalidRequest(format!(
            "{} is {len} bytes; the maximum is {max}",
            what()
        )));
    }
    Ok(())
}

impl<'r> CheckRequest<'r> {
    pub fn parse(
        request: &'r RateLimitRequest,
        bounds: &Bounds,
    ) -> Result<CheckRequest<'r>, InvalidRequest> {
        // The first two texts are the reference's.
        if request.domain.is_empty() {
            return Err(InvalidRequest("rate limit domain must not be empty".into()));
        }
        check_len(
            || "domain".into(),
            request.domain.len(),
            bounds.max_descriptor_bytes,
        )?;
        if request.descriptors.is_empty() {
            return Err(InvalidRequest(
                "rate limit descriptor list must not be empty".into(),
            ));
        }
        if request.descriptors.len() > bounds.max_descriptors {
            return Err(InvalidRequest(format!(
                "{} descriptors; the maximum is {}",
                request.descriptors.len(),
                bounds.max_descriptors
            )));
        }
        // Envoy sends 0 when unset; the reference treats it as 1.
        let request_hits = u64::from(request.hits_addend.max(1));
        let descriptors = request
            .descriptors
            .iter()
            .enumerate()
            .map(|(i, d)| Descriptor::parse(i, d, request_hits, bounds))
            .collect::<Result<_, _>>()?;
        Ok(CheckRequest {
            domain: &request.domain,
            descriptors,
        })
    }
}

impl<'r> Descriptor<'r> {
    fn parse(
        index: usize,
        descriptor: &'r RateLimitDescriptor,
        request_hits: u64,
        bounds: &Bounds,
    ) -> Result<Descriptor<'r>, InvalidRequest> {
        let invalid = |what: String| InvalidRequest(format!("descriptor {index}: {what}"));
        if descriptor.entries.is_empty() {
            return Err(invalid("has no entries".into()));
        }
        if descriptor.entries.len() > bounds.max_entries {
            return Err(invalid(format!(
                "{} entries; the maximum is {}",
                descriptor.entries.len(),
                bounds.max_entries
            )));
        }
        let mut entries = Vec::with_capacity(descriptor.entries.len());
        for (j, entry) in descriptor.entries.iter().enumerate() {
            if entry.key.is_empty() {
                return Err(invalid(format!("entry {j} has an empty key")));
            }
            entries.push((entry.key.as_str(), entry.value.as_str()));
        }
        check_len(
            || format!("descriptor {index}: keys and values together"),
            entries.iter().map(|(k, v)| k.len() + v.len()).sum(),
            bounds.max_descriptor_bytes,
        )?;
        let limit_override = match &descriptor.limit {
            None => None,
            Some(o) if o.unit == ProtoUnit::Unknown as i32 => None,
            Some(o) => Some(Override {
                requests_per_unit: o.requests_per_unit,
                unit: Unit::from_proto(o.unit).ok_or_else(|| {
                    invalid(format!("limit override has an invalid unit ({})", o.unit))
                })?,
            }),
        };
        // A descriptor's own addend wins, including 0 ("check only"). Costs are capped at
        // u32::MAX: any larger cost is over every limit just the same. Negative hits (sent
        // when a stream ends) charge nothing: they give back a concurrency permit, or read.
        let hits = if descriptor.is_negative_hits {
            0
        } else {
            descriptor
                .hits_addend
                .map_or(request_hits, |h| h.value)
                .min(u64::from(u32::MAX))
        };
        Ok(Descriptor {
            entries,
            limit_override,
            hits,
            release: descriptor.is_negative_hits,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
        Entry, RateLimitOverride,
    };
    use envoy_types::pb::google::protobuf::UInt64Value;

    fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry {
                    key: (*k).into(),
                    value: (*v).into(),
                })
                .collect(),
            ..Default::default()
        }
    }

    fn request(descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
        RateLimitRequest {
            domain: "d".into(),
            descriptors,
            hits_addend: 0,
        }
    }

    fn error(r: &RateLimitRequest) -> String {
        CheckRequest::parse(r, &Bounds::default()).unwrap_err().0
    }

    #[test]
    fn malformed_requests_are_refused_with_a_message() {
        let mut r = request(vec![descriptor(&[("k", "v")])]);
        r.domain.clear();
        assert_eq!(error(&r), "rate limit domain must not be empty");
        assert_eq!(
            error(&request(vec![])),
            "rate limit descriptor list must not be empty"
        );
        assert_eq!(
            error(&request(vec![descriptor(&[])])),
            "descriptor 0: has no entries"
        );
        assert_eq!(
            error(&request(vec![
                descriptor(&[("k", "v")]),
                descriptor(&[("a", "b"), ("", "x")])
            ])),
            "descriptor 1: entry 1 has an empty key"
        );
        // 4 096 bytes of keys and values pass; one more does not, however it is split.
        let fits = descriptor(&[("k", &"x".repeat(2047)), ("key", &"y".repeat(2045))]);
        assert!(CheckRequest::parse(&request(vec![fits]), &Bounds::default()).is_ok());
        assert_eq!(
            error(&request(vec![descriptor(&[
                ("k", &"x".repeat(2048)),
                ("key", &"y".repeat(2045))
            ])])),
            "descriptor 0: keys and values together is 4097 bytes; the maximum is 4096"
        );
        assert_eq!(
            error(&request(vec![
                descriptor(&[("k", "v")]),
                descriptor(&[("k", "v"); 1366])
            ])),
            "descriptor 1: 1366 entries; the maximum is 32"
        );
        assert_eq!(
            error(&request(vec![descriptor(&[("k", "v")]); 65])),
            "65 descriptors; the maximum is 64"
        );
        let mut d = descriptor(&[("k", "v")]);
        d.limit = Some(RateLimitOverride {
            requests_per_unit: 5,
            unit: 99,
        });
        assert_eq!(
            error(&request(vec![d])),
            "descriptor 0: limit override has an invalid unit (99)"
        );
    }

    #[test]
    fn overrides_envoy_can_send_are_answered_not_refused() {
        // (requests_per_unit, unit) -> the override in force.
        for (requests_per_unit, unit, expected) in [
            (
                0,
                1,
                Some(Override {
                    requests_per_unit: 0,
                    unit: Unit::Second,
                }),
            ),
            (
                5,
                7,
                Some(Override {
                    requests_per_unit: 5,
                    unit: Unit::Week,
                }),
            ),
            (5, 0, None),
        ] {
            let mut d = descriptor(&[("k", "v")]);
            d.limit = Some(RateLimitOverride {
                requests_per_unit,
                unit,
            });
            let r = request(vec![d]);
            let parsed = CheckRequest::parse(&r, &Bounds::default()).unwrap();
            assert_eq!(parsed.descriptors[0].limit_override, expected);
        }
    }

    #[test]
    fn hits_follow_the_reference_and_saturate() {
        let mut r = request(vec![descriptor(&[("k", "v")]); 4]);
        r.hits_addend = 0;
        r.descriptors[1].hits_addend = Some(UInt64Value { value: 0 });
        r.descriptors[2].hits_addend = Some(UInt64Value { value: u64::MAX });
        r.descriptors[3].is_negative_hits = true;
        let parsed = CheckRequest::parse(&r, &Bounds::default()).unwrap();
        let hits: Vec<u64> = parsed.descriptors.iter().map(|d| d.hits).collect();
        assert_eq!(hits, [1, 0, u64::from(u32::MAX), 0]);
        r.hits_addend = 7;
        let parsed = CheckRequest::parse(&r, &Bounds::default()).unwrap();
        assert_eq!(parsed.descriptors[0].hits, 7);
    }
}
