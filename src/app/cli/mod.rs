//! The command line. Every flag can also come from the environment; where the reference
//! server has a variable for the same setting, it has the same name (GRPC_PORT, PORT,
//! REDIS_URL, REDIS_TYPE, CACHE_KEY_PREFIX, SHADOW_MODE, LOG_LEVEL, ...).
//!
//! `serve`'s flags come in groups, one file each; a group turns itself into the settings of
//! the part it configures, so `run` hands each part its group whole.

mod answers;
mod backend;
mod failure;
mod grpc;
mod http;
mod limits;
mod observability;
mod redis;
mod rlqs;
mod rules;
mod xds;

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

pub use answers::{AnswerArgs, ChargingArg, HeadersArg, MetadataArg};
pub use backend::{BackendArgs, BackendKind};
pub use failure::{FailureArgs, PolicyArg};
pub use grpc::GrpcArgs;
pub use http::HttpArgs;
pub use limits::LimitsArgs;
pub use observability::ObservabilityArgs;
pub use redis::{KeyLayoutArg, RedisArgs, RedisType};
pub use rlqs::RlqsArgs;
pub use rules::{ConfigType, RuleSourceArgs, RulesArgs};
pub use xds::XdsArgs;

use crate::service::Settings;

#[derive(Debug, Parser)]
#[command(
    name = "turnstile",
    version,
    about = "A global rate-limit service for Envoy and Istio"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the service.
    Serve(Box<ServeArgs>),
    /// Validate rule files: exit 0 with a summary, or 1 listing every error.
    Check(CheckArgs),
    /// Which rule a descriptor matches, and why; with --instance, where its counter stands.
    /// Exit 0 when every descriptor matches a rule, 1 when one matches none, 2 on errors.
    Explain(ExplainArgs),
    /// Print the Redis batch script every decision runs (for SCRIPT LOAD, or a benchmark);
    /// its SHA-1, the hash turnstile calls it by, goes to stderr.
    RedisScript(RedisScriptArgs),
}

#[derive(Debug, Args)]
pub struct RedisScriptArgs {
    /// Print it as the function library turnstile loads on Redis 7 (for FUNCTION LOAD);
    /// its function's name, the one turnstile calls (FCALL), goes to stderr.
    #[arg(long)]
    pub library: bool,
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub rules: RulesArgs,
}

/// Where the rules are: `--config`, or else the reference's runtime layout.
/// `turnstile explain`: which rule a descriptor matches, and why (see `explain`).
#[derive(Debug, Args)]
pub struct ExplainArgs {
    #[command(flatten)]
    pub rules: RulesArgs,
    /// The domain the request was sent with (the Envoy filter's `domain`).
    #[arg(long)]
    pub domain: String,
    /// One descriptor as `key=value,key=value` (values without commas); repeat it for every
    /// descriptor of the request.
    #[arg(
        long = "descriptor",
        short = 'd',
        value_name = "KEY=VALUE[,KEY=VALUE...]"
    )]
    pub descriptors: Vec<String>,
    /// The entries of one descriptor, in order (any value, commas included).
    #[arg(value_name = "KEY=VALUE")]
    pub entries: Vec<String>,
    /// A running instance's gRPC address (`host:port` or a URL): also show, for every
    /// descriptor, what it answers now (remaining, reset), read without charging.
    #[arg(long, value_name = "ADDRESS")]
    pub instance: Option<String>,
}

/// `turnstile serve`: its flags by concern, each group under a heading of its own in --help.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Report not-serving while the rules define no domain.
    #[arg(long, env = "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED")]
    pub healthy_with_at_least_one_config_loaded: bool,
    /// How long a shutdown waits for in-flight calls and open connections.
    #[arg(long, env = "TURNSTILE_SHUTDOWN_GRACE", value_parser = duration, default_value = "10s")]
    pub shutdown_grace: Duration,

    #[command(flatten)]
    pub rules: RuleSourceArgs,
    #[command(flatten)]
    pub grpc: GrpcArgs,
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub limits: LimitsArgs,
    #[command(flatten)]
    pub answers: AnswerArgs,
    #[command(flatten)]
    pub backend: BackendArgs,
    #[command(flatten)]
    pub failure: FailureArgs,
    #[command(flatten)]
    pub rlqs: RlqsArgs,
    #[command(flatten)]
    pub observability: ObservabilityArgs,
}

impl ServeArgs {
    /// How the service decides and answers.
    pub fn settings(&self) -> Settings {
        Settings {
            bounds: self.limits.bounds(),
            charging: self.answers.charging.into(),
            response: self.answers.response(),
            on_backend_error: self.failure.on_backend_error.into(),
            quota_mode: self.answers.quota_mode,
            request_timeout: self.limits.request_timeout,
        }
    }

    /// How many threads serve gRPC (see [`GrpcArgs::threads`]).
    pub fn grpc_threads(&self) -> usize {
        self.grpc.threads(self.backend.kind())
    }
}

fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| e.to_string())
}

/// A duration above zero: a timer that would fire at once at zero (a connection's ping or
/// close, a wait for replicas).
fn positive_duration(text: &str) -> Result<Duration, String> {
    match duration(text)? {
        zero if zero.is_zero() => Err(format!("{text}: must be more than zero")),
        positive => Ok(positive),
    }
}

/// A file named on the command line (a certificate, a key), with its path in the error.
fn read(path: &Path) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
}

/// `turnstile serve` with these arguments, as the binary parses them.
#[cfg(test)]
pub(crate) fn parse_serve(args: &[&str]) -> Result<Box<ServeArgs>, clap::Error> {
    let line = ["turnstile", "serve"].iter().chain(args).copied();
    match Cli::try_parse_from(line)?.command {
        Command::Serve(serve) => Ok(serve),
        _ => unreachable!("a serve command line"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// No two flags share a long name or an environment variable (flattened groups could).
    #[test]
    fn every_flag_and_variable_is_named_once() {
        let cli = Cli::command();
        let serve = cli.find_subcommand("serve").expect("serve");
        let mut longs: Vec<_> = serve.get_arguments().filter_map(|a| a.get_long()).collect();
        let mut envs: Vec<_> = serve.get_arguments().filter_map(|a| a.get_env()).collect();
        let (all_longs, all_envs) = (longs.len(), envs.len());
        longs.sort_unstable();
        longs.dedup();
        envs.sort_unstable();
        envs.dedup();
        assert_eq!((longs.len(), envs.len()), (all_longs, all_envs));
    }

    /// The service's settings come from three groups; the defaults are the reference's.
    #[test]
    fn settings_take_bounds_answers_and_the_failure_policy() {
        use crate::decision::{Charging, FailurePolicy};
        let defaults = parse_serve(&[]).unwrap().settings();
        assert_eq!(defaults.charging, Charging::Atomic);
        assert_eq!(defaults.on_backend_error, FailurePolicy::Error);
        assert!(!defaults.quota_mode);
        assert_eq!(defaults.request_timeout, Duration::from_secs(1));
        let set = parse_serve(&[
            "--charging",
            "per-descriptor",
            "--on-backend-error",
            "allow",
            "--quota-mode",
            "--max-descriptors",
            "3",
            "--request-timeout",
            "2s",
        ])
        .unwrap()
        .settings();
        assert_eq!(set.charging, Charging::PerDescriptor);
        assert_eq!(set.on_backend_error, FailurePolicy::Allow);
        assert!(set.quota_mode);
        assert_eq!(set.bounds.max_descriptors, 3);
        assert_eq!(set.request_timeout, Duration::from_secs(2));
    }
}
