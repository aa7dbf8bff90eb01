//! Envoy's Rate Limit Quota Service (RLQS): Envoys enforce the global limits locally, with
//! shares turnstile assigns and rebalances, so no call sits on the request path.
//!
//! Each Envoy holds one stream (`StreamRateLimitQuotas`) and reports, per bucket, how many
//! requests it allowed and denied (Envoy 1.40: every 5 s). Every report is answered with the
//! Envoy's share of the bucket's rule as a token bucket (`share`), reserved in the backend
//! (`store`) so that the shares of all Envoys, through any number of turnstile instances,
//! never add up to more than the limit. The bucket id is matched to the same rules as a
//! descriptor (`bucket`). The stream's bookkeeping is in `stream`.

mod bucket;
mod budget;
mod buffers;
mod share;
mod store;
mod stream;

use std::time::Duration;

use metrics::{Counter, Gauge, Label};

use crate::decision::FailurePolicy;
use crate::ops::metrics::Metrics;
use crate::service::request::Bounds;
pub use store::{MemoryShares, ShareStore};
pub use stream::QuotaService;

/// Bytes of limited buckets one stream may track (ids and state keys, plus a fixed cost per
/// bucket); past this, new ones are denied (they cannot be given a share untracked), so no
/// stream can grow the server's memory without bound. About 30 000 buckets of short ids.
pub const MAX_STREAM_BYTES: usize = 4 << 20;

/// Default bound on the bytes all streams together track (`Settings::max_bytes`).
pub const DEFAULT_MAX_BYTES: usize = 64 << 20;

/// Default bound on the bytes all streams' reports and answers hold together
/// (`Settings::max_buffer_bytes`): about twice what the tracked buckets' ids make, since a
/// report and its answer each carry them.
pub const DEFAULT_MAX_BUFFER_BYTES: usize = 128 << 20;

/// Default bound on the streams open at once (`Settings::max_streams`).
pub const DEFAULT_MAX_STREAMS: usize = 1_024;

/// Default bound on the streams one peer address holds (`Settings::max_streams_per_peer`).
pub const DEFAULT_MAX_STREAMS_PER_PEER: usize = 64;

/// How the service is set up.
pub struct Settings {
    /// An assignment's life without a new report (and its reservation's).
    pub ttl: Duration,
    /// Answer when the shared store fails, unless the domain's rules say otherwise.
    pub on_backend_error: FailurePolicy,
    pub bounds: Bounds,
    /// Bytes of limited buckets all streams together may track, counted as a stream's are
    /// (`MAX_STREAM_BYTES`), so that many streams cannot do what one may not. A stream's
    /// bytes count until its reservations are gone: at once when Envoy ends it, else a TTL
    /// after it broke, while its shares still stand in the store.
    pub max_bytes: usize,
    /// Bytes all streams' reports and answers hold together, counted as each stream's largest
    /// report and largest answer (its buffers keep that size) from the moment a report's
    /// prefix declares it: one past it ends its stream RESOURCE_EXHAUSTED, and its Envoy
    /// opens another. A stream whose sizes do not grow needs nothing more.
    pub max_buffer_bytes: usize,
    /// Streams open at once, all Envoys together: each costs a little besides what it
    /// tracks and buffers, so their number is bounded too. One more is refused
    /// RESOURCE_EXHAUSTED, and its Envoy retries.
    pub max_streams: usize,
    /// Of those, the most one peer address may hold, so that one client cannot take them
    /// all.
    pub max_streams_per_peer: usize,
}

/// What the service counts.
struct RlqsMetrics {
    streams: Gauge,
    reports: Counter,
    token_bucket: Counter,
    allow_all: Counter,
    deny_all: Counter,
    unanswered: Counter,
}

impl RlqsMetrics {
    fn new(metrics: &Metrics) -> RlqsMetrics {
        let action = |name: &'static str| {
            metrics.counter(
                "turnstile_rlqs_assignments",
                vec![Label::new("action", name)],
            )
        };
        RlqsMetrics {
            streams: metrics.gauge("turnstile_rlqs_streams"),
            reports: metrics.counter("turnstile_rlqs_bucket_reports", Vec::new()),
            token_bucket: action("token_bucket"),
            allow_all: action("allow_all"),
            deny_all: action("deny_all"),
            unanswered: action("none"),
        }
    }
}
