//! What one call may be: calls in flight, the size of a message and of its descriptors, and
//! how long it may last.

use std::time::Duration;

use clap::Args;

use super::duration;
use crate::service::request::Bounds;

#[derive(Debug, Args)]
#[command(next_help_heading = "Calls and requests")]
pub struct LimitsArgs {
    /// Most calls in flight; past it calls are refused at once with RESOURCE_EXHAUSTED. A
    /// ShouldRateLimit call counts from when its message has arrived.
    #[arg(long, env = "TURNSTILE_MAX_IN_FLIGHT", default_value_t = 10_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub max_in_flight: usize,
    /// Of those, the most from one peer address (over all its connections), so that one
    /// client cannot take every place and have everyone else's calls refused (which Envoy
    /// lets through). An Envoy with its default circuit breakers keeps at most 1 024
    /// requests in flight to one cluster; clients behind one NAT share an address, so raise
    /// it there.
    #[arg(long, env = "TURNSTILE_MAX_IN_FLIGHT_PER_PEER", default_value_t = 1_024, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub max_in_flight_per_peer: usize,
    /// Largest gRPC request accepted, in bytes.
    #[arg(long, env = "TURNSTILE_MAX_MESSAGE_BYTES", default_value_t = 1 << 20)]
    pub max_message_bytes: usize,
    /// Bound on a whole call, whatever it waits for.
    #[arg(long, env = "TURNSTILE_REQUEST_TIMEOUT", value_parser = duration, default_value = "1s")]
    pub request_timeout: Duration,
    /// Most descriptors in one request.
    #[arg(long, env = "TURNSTILE_MAX_DESCRIPTORS", default_value_t = 64)]
    pub max_descriptors: usize,
    /// Most entries in one descriptor.
    #[arg(long, env = "TURNSTILE_MAX_ENTRIES", default_value_t = 32)]
    pub max_entries: usize,
    /// Most bytes in a descriptor's keys and values together (and in the domain). It bounds
    /// what one backend key or metric series can cost.
    #[arg(long, env = "TURNSTILE_MAX_DESCRIPTOR_BYTES", default_value_t = crate::service::request::DEFAULT_MAX_DESCRIPTOR_BYTES)]
    pub max_descriptor_bytes: usize,
}

impl LimitsArgs {
    pub fn bounds(&self) -> Bounds {
        Bounds {
            max_descriptors: self.max_descriptors,
            max_entries: self.max_entries,
            max_descriptor_bytes: self.max_descriptor_bytes,
        }
    }
}
