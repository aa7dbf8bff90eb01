//! One Envoy's share of a bucket's limit, and the token bucket that enforces it.
//!
//! Shares follow recent demand (an equal split starves a busy Envoy), and every share is
//! reserved in the shared state: an Envoy gets at most what the others' live reservations
//! leave free, so the shares handed out never add up to more than the limit, however demand
//! shifts between reports. An Envoy whose demand grows gets the rest at its next report,
//! after the others have shrunk at theirs. `lua/rlqs_share.lua` is this arithmetic's twin
//! for Redis.

use std::time::Duration;

use envoy_types::pb::envoy::r#type::v3::RateLimitStrategy;
use envoy_types::pb::envoy::r#type::v3::TokenBucket;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::google::protobuf::{Duration as ProtoDuration, UInt32Value};

use crate::decision::limit::Limit;

/// Each Envoy's weight is its demand plus this fraction of the limit, so an idle Envoy keeps
/// a small share to serve its next requests with (and to report their demand).
pub const IDLE_WEIGHT: f64 = 0.05;

/// A held share up to this fraction below its target is kept as is: a changed assignment
/// rebuilds Envoy's bucket full, so churn would admit extra bursts. Shares shrink at once
/// (another Envoy may be waiting for the difference) and grow lazily, so a target that wobbles
/// settles on its low side.
pub const HYSTERESIS: f64 = 0.1;

const EPSILON: f64 = 1e-9;

/// What the other Envoys reporting a bucket hold.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Others {
    /// Sum of their weights (demand plus idle weight).
    pub weight: f64,
    /// Sum of their reserved shares.
    pub reserved: u64,
}

/// The share (requests per window of `limit`) for an Envoy with `demand` (requests per
/// window), given the others and the share it holds now, if any.
pub fn assign(limit: u64, demand: f64, others: Others, held: Option<u64>) -> u64 {
    let weight = demand + limit as f64 * IDLE_WEIGHT;
    // The epsilon keeps a whole share whole (100 * w / w can come out as 99.999...).
    let target = (limit as f64 * weight / (weight + others.weight) + EPSILON).floor() as u64;
    let free = limit.saturating_sub(others.reserved);
    match held {
        Some(held)
            if held <= free.min(target) && (target - held) as f64 <= target as f64 * HYSTERESIS =>
        {
            held
        }
        _ => target.min(free),
    }
}

/// A share as Envoy enforces it: a token bucket refilling `share` tokens per window, holding
/// the same part of the rule's burst. Envoy 1.40 reads `fill_interval` in whole seconds and
/// takes an unset `tokens_per_fill` as 0, so both are always set.
pub fn token_bucket(limit: &Limit, share: u64) -> RateLimitStrategy {
    let of_burst = u64::from(limit.burst) * share / u64::from(limit.requests_per_unit.max(1));
    let clamp = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
    RateLimitStrategy {
        strategy: Some(Strategy::TokenBucket(TokenBucket {
            max_tokens: clamp(of_burst),
            tokens_per_fill: Some(UInt32Value {
                value: clamp(share),
            }),
            fill_interval: Some(proto_duration(Duration::from_secs(limit.window.max(1)))),
        })),
    }
}

pub fn blanket(rule: BlanketRule) -> RateLimitStrategy {
    RateLimitStrategy {
        strategy: Some(Strategy::BlanketRule(rule as i32)),
    }
}

pub fn proto_duration(d: Duration) -> ProtoDuration {
    ProtoDuration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: d.subsec_nanos() as i32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::limit::{Algorithm, Unit};

    #[test]
    fn shares_follow_demand_and_never_exceed_what_is_free() {
        let idle = 100.0 * IDLE_WEIGHT;
        // (demand, others, held, share) for a limit of 100
        let cases = [
            // Alone: all of it.
            (50.0, Others::default(), None, 100),
            // 9:1 demand, nothing reserved yet: 90% less the others' idle weight.
            (
                90.0,
                Others {
                    weight: 10.0 + idle,
                    reserved: 0,
                },
                None,
                86,
            ),
            (
                10.0,
                Others {
                    weight: 90.0 + idle,
                    reserved: 0,
                },
                None,
                13,
            ),
            // The others still hold 50: at most the free 50, whatever the demand.
            (
                90.0,
                Others {
                    weight: 10.0 + idle,
                    reserved: 50,
                },
                None,
                50,
            ),
            // Up to 10% below the target: kept (no rebuild of Envoy's bucket).
            (
                90.0,
                Others {
                    weight: 10.0 + idle,
                    reserved: 10,
                },
                Some(80),
                80,
            ),
            // Further below: grown.
            (
                90.0,
                Others {
                    weight: 10.0 + idle,
                    reserved: 10,
                },
                Some(60),
                86,
            ),
            // Above the target: shrunk at once.
            (
                90.0,
                Others {
                    weight: 10.0 + idle,
                    reserved: 10,
                },
                Some(88),
                86,
            ),
            // Held, but no longer free (the others' reservations grew): cut to what is free.
            (
                90.0,
                Others {
                    weight: 10.0 + idle,
                    reserved: 30,
                },
                Some(80),
                70,
            ),
            // Over-reserved (a reload lowered the limit): nothing.
            (
                90.0,
                Others {
                    weight: 10.0,
                    reserved: 120,
                },
                Some(80),
                0,
            ),
        ];
        for (demand, others, held, share) in cases {
            assert_eq!(
                assign(100, demand, others, held),
                share,
                "{demand} {others:?} {held:?}"
            );
        }
    }

    #[test]
    fn token_buckets_refill_the_share_per_window_and_hold_its_part_of_the_burst() {
        let limit = Limit {
            algorithm: Algorithm::TokenBucket,
            burst: 20,
            ..Limit::fixed(100, Unit::Minute)
        };
        let Some(Strategy::TokenBucket(bucket)) = token_bucket(&limit, 30).strategy else {
            panic!("not a token bucket");
        };
        assert_eq!(bucket.max_tokens, 6);
        assert_eq!(bucket.tokens_per_fill, Some(UInt32Value { value: 30 }));
        assert_eq!(bucket.fill_interval.map(|d| d.seconds), Some(60));
    }
}
