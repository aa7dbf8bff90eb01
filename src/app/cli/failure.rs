//! When the backend fails: what to answer, and when the circuit breaker stops asking it.

use std::time::Duration;

use clap::{Args, ValueEnum};

use super::duration;
use crate::backend::breaker::BreakerConfig;
use crate::decision::FailurePolicy;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyArg {
    /// Answer UNAVAILABLE: Envoy's failure_mode_deny decides (the reference's behaviour).
    Error,
    /// Admit (fail open).
    Allow,
    /// Refuse (fail closed).
    Deny,
    /// Limit in this process at --local-share of each limit.
    Local,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "When the backend fails")]
pub struct FailureArgs {
    /// What to answer when the backend fails or times out (a domain's `on_backend_error`
    /// overrides it): error (UNAVAILABLE), allow, deny, or local limiting.
    #[arg(
        long,
        env = "TURNSTILE_ON_BACKEND_ERROR",
        value_enum,
        default_value = "error"
    )]
    pub on_backend_error: PolicyArg,
    /// Share of each limit an instance enforces alone in `local` mode: 1/N for N instances.
    #[arg(long, env = "TURNSTILE_LOCAL_SHARE", default_value_t = 1.0)]
    pub local_share: f64,
    /// Keys `local` mode keeps about: the charges it owes the backend for what it admitted
    /// alone (charged there once the backend answers, before deciding from it again), and
    /// what the backend last said was left of each limit (where a key's local share starts).
    /// A request that would owe on a new key while the ledger is full of charges whose
    /// windows have not ended is refused.
    #[arg(long, env = "TURNSTILE_LOCAL_LEDGER_KEYS", default_value_t = 100_000)]
    pub local_ledger_keys: usize,
    /// Consecutive backend failures that open the circuit breaker.
    #[arg(long, env = "TURNSTILE_BREAKER_FAILURES", default_value_t = 5)]
    pub breaker_failures: u32,
    /// Longest wait between probes of a failed backend.
    #[arg(long, env = "TURNSTILE_BREAKER_MAX_BACKOFF", value_parser = duration, default_value = "1s")]
    pub breaker_max_backoff: Duration,
}

impl From<PolicyArg> for FailurePolicy {
    fn from(policy: PolicyArg) -> FailurePolicy {
        match policy {
            PolicyArg::Error => FailurePolicy::Error,
            PolicyArg::Allow => FailurePolicy::Allow,
            PolicyArg::Deny => FailurePolicy::Deny,
            PolicyArg::Local => FailurePolicy::Local,
        }
    }
}

impl FailureArgs {
    pub fn breaker(&self) -> BreakerConfig {
        BreakerConfig {
            failures_to_open: self.breaker_failures,
            max_backoff: self.breaker_max_backoff,
            ..BreakerConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_serve;
    use super::*;

    #[test]
    fn each_policy_is_its_own() {
        for (text, policy) in [
            ("error", FailurePolicy::Error),
            ("allow", FailurePolicy::Allow),
            ("deny", FailurePolicy::Deny),
            ("local", FailurePolicy::Local),
        ] {
            let failure = parse_serve(&["--on-backend-error", text]).unwrap().failure;
            assert_eq!(FailurePolicy::from(failure.on_backend_error), policy);
        }
    }

    #[test]
    fn the_breaker_takes_its_two_flags() {
        let breaker = parse_serve(&["--breaker-failures", "7", "--breaker-max-backoff", "3s"])
            .unwrap()
            .failure
            .breaker();
        assert_eq!(breaker.failures_to_open, 7);
        assert_eq!(breaker.max_backoff, Duration::from_secs(3));
        assert_eq!(
            breaker.initial_backoff,
            BreakerConfig::default().initial_backoff
        );
        assert_eq!(
            parse_serve(&[]).unwrap().failure.breaker(),
            BreakerConfig::default()
        );
    }
}
