//! The RLQS service's shares and bounds.

use std::time::Duration;

use clap::Args;

use super::duration;
use crate::decision::FailurePolicy;
use crate::rlqs::Settings;
use crate::service::request::Bounds;

#[derive(Debug, Args)]
#[command(next_help_heading = "RLQS")]
pub struct RlqsArgs {
    /// How long an RLQS share lasts without a new report: the assignment_time_to_live sent
    /// to Envoy and the life of the stream's reservation in the backend. Envoy 1.40 reports
    /// every 5 s, so this must be well above 5 s.
    #[arg(long, env = "TURNSTILE_RLQS_TTL", value_parser = duration, default_value = "15s")]
    pub rlqs_ttl: Duration,
    /// Bytes of limited buckets all RLQS streams together may track (a stream alone: 4 MiB);
    /// past it, new buckets get DENY_ALL.
    #[arg(long, env = "TURNSTILE_RLQS_MAX_BYTES", default_value_t = crate::rlqs::DEFAULT_MAX_BYTES)]
    pub rlqs_max_bytes: usize,
    /// Bytes all RLQS streams' reports and answers may hold together, each stream counted at
    /// its largest report and largest answer (what its buffers keep); a report or answer
    /// past it ends its stream RESOURCE_EXHAUSTED (its Envoy opens another).
    #[arg(long, env = "TURNSTILE_RLQS_MAX_BUFFER_BYTES", default_value_t = crate::rlqs::DEFAULT_MAX_BUFFER_BYTES)]
    pub rlqs_max_buffer_bytes: usize,
    /// Most RLQS streams open at once, all Envoys together; one more is refused
    /// RESOURCE_EXHAUSTED (its Envoy retries).
    #[arg(long, env = "TURNSTILE_RLQS_MAX_STREAMS", default_value_t = crate::rlqs::DEFAULT_MAX_STREAMS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub rlqs_max_streams: usize,
    /// Of those, the most one peer address may hold; one more from it is refused
    /// RESOURCE_EXHAUSTED.
    #[arg(long, env = "TURNSTILE_RLQS_MAX_STREAMS_PER_PEER", default_value_t = crate::rlqs::DEFAULT_MAX_STREAMS_PER_PEER, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub rlqs_max_streams_per_peer: usize,
}

impl RlqsArgs {
    /// Its settings, with the failure policy and request bounds the service has too.
    pub fn settings(&self, on_backend_error: FailurePolicy, bounds: Bounds) -> Settings {
        Settings {
            ttl: self.rlqs_ttl,
            on_backend_error,
            bounds,
            max_bytes: self.rlqs_max_bytes,
            max_buffer_bytes: self.rlqs_max_buffer_bytes,
            max_streams: self.rlqs_max_streams,
            max_streams_per_peer: self.rlqs_max_streams_per_peer,
        }
    }
}
