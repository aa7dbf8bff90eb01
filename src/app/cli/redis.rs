//! The Redis backend: where it is (single, Sentinel, Cluster), how it is reached (TLS,
//! credentials, timeouts, connections, batching), and where its keys are.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use super::{duration, positive_duration, read};
use crate::backend::redis::{KeyLayout, RedisConfig, RedisMode, RedisTls, Wait};

const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RedisType {
    Single,
    Sentinel,
    Cluster,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KeyLayoutArg {
    Turnstile,
    Reference,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Redis")]
pub struct RedisArgs {
    /// Redis address(es): redis:// or rediss:// URLs or host:port, comma-separated. For
    /// Sentinel the first item is the master's name, then the sentinels (as the reference).
    /// Default: redis://127.0.0.1:6379.
    #[arg(long, env = "REDIS_URL")]
    pub redis_url: Option<String>,
    #[arg(
        long,
        env = "REDIS_TYPE",
        value_enum,
        ignore_case = true,
        default_value = "single"
    )]
    pub redis_type: RedisType,
    /// Multiplexed Redis connections (per node on a Cluster) of each thread serving gRPC, and
    /// of the Redis I/O thread; also the script calls each has in flight per server (per
    /// Cluster slot).
    #[arg(long, env = "REDIS_POOL_SIZE", default_value_t = 2)]
    pub redis_connections: usize,
    /// Most requests one Redis script call decides: requests arriving while calls are in
    /// flight (at most REDIS_POOL_SIZE per serving thread and server, or Cluster slot) share
    /// the next call, each decided on its own. 1 turns coalescing off: every request is a
    /// call of its own.
    #[arg(long, env = "TURNSTILE_REDIS_BATCH", default_value_t = 64, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    pub redis_batch: usize,
    /// The Redis I/O thread's scheduler slice (Linux 6.12+; ignored elsewhere): a short one
    /// lets the thread run as soon as it is woken, rather than after the slice of whatever
    /// runs on its CPU, and leaves its share of the CPU as it is. 0: the kernel's default.
    #[arg(long, env = "TURNSTILE_REDIS_IO_SLICE", value_parser = io_slice, default_value = "100us")]
    pub redis_io_slice: Duration,
    /// Bound on every Redis call; past it the call counts as failed.
    #[arg(long, env = "TURNSTILE_REDIS_TIMEOUT", value_parser = duration, default_value = "25ms")]
    pub redis_timeout: Duration,
    /// Replicas that must have every script call's writes before its answer counts (Redis
    /// `WAIT`, sent right after the call on its connection, once per call however many
    /// requests it decides): a failover to one of them then loses no charge. Fewer in time
    /// (--redis-wait-timeout) is a backend error, answered by the failure policy. 0: no wait.
    #[arg(long, env = "REDIS_WAIT_REPLICAS", default_value_t = 0)]
    pub redis_wait_replicas: u32,
    /// How long a call waits for --redis-wait-replicas; within --redis-timeout.
    #[arg(long, env = "REDIS_WAIT_TIMEOUT", value_parser = positive_duration, default_value = "10ms")]
    pub redis_wait_timeout: Duration,
    /// Bound on connecting to Redis.
    #[arg(long, env = "TURNSTILE_REDIS_CONNECT_TIMEOUT", value_parser = duration, default_value = "1s")]
    pub redis_connect_timeout: Duration,
    /// Redis credentials, `password` or `user:password`, for URLs that carry none.
    #[arg(long, env = "REDIS_AUTH", hide_env_values = true)]
    pub redis_auth: Option<String>,
    /// Connect with TLS to bare `host:port` Redis addresses.
    #[arg(long, env = "REDIS_TLS")]
    pub redis_tls: bool,
    /// PEM CA to trust for rediss:// URLs instead of the system's roots.
    #[arg(long, env = "REDIS_TLS_CACERT")]
    pub redis_tls_cacert: Option<PathBuf>,
    /// PEM client certificate for Redis servers that require one.
    #[arg(long, env = "REDIS_TLS_CLIENT_CERT", requires = "redis_tls_client_key")]
    pub redis_tls_client_cert: Option<PathBuf>,
    /// PEM key of the client certificate.
    #[arg(long, env = "REDIS_TLS_CLIENT_KEY", requires = "redis_tls_client_cert")]
    pub redis_tls_client_key: Option<PathBuf>,
    /// Where fixed-window counters live in Redis: turnstile's keys, or the reference's
    /// (`<prefix><domain>_<key>_<value>_..._<window start>`) to share counters with running
    /// reference servers during a switch.
    #[arg(
        long,
        env = "TURNSTILE_KEY_LAYOUT",
        value_enum,
        default_value = "turnstile"
    )]
    pub key_layout: KeyLayoutArg,
    /// Prefix of every Redis key.
    #[arg(long, env = "CACHE_KEY_PREFIX", default_value = "")]
    pub cache_key_prefix: String,
}

/// 0, or a slice Linux takes: 100 µs to 100 ms.
fn io_slice(text: &str) -> Result<Duration, String> {
    let slice = duration(text)?;
    if slice.is_zero() || (Duration::from_micros(100)..=Duration::from_millis(100)).contains(&slice)
    {
        Ok(slice)
    } else {
        Err(format!(
            "{text} is not a slice Linux takes: 0 (the kernel's default) or 100us to 100ms"
        ))
    }
}

impl From<KeyLayoutArg> for KeyLayout {
    fn from(layout: KeyLayoutArg) -> KeyLayout {
        match layout {
            KeyLayoutArg::Turnstile => KeyLayout::Turnstile,
            KeyLayoutArg::Reference => KeyLayout::Reference,
        }
    }
}

impl RedisArgs {
    /// The Redis settings (certificates read); `REDIS_URL` is read as the reference reads
    /// it: one address, a comma-separated list of Cluster seeds, or for Sentinel the
    /// master's name followed by the Sentinels' addresses.
    pub fn config(&self) -> anyhow::Result<RedisConfig> {
        let mut urls: Vec<String> = self
            .redis_url
            .as_deref()
            .unwrap_or(DEFAULT_REDIS_URL)
            .split(',')
            .map(|u| u.trim().to_owned())
            .filter(|u| !u.is_empty())
            .collect();
        let mode = match self.redis_type {
            RedisType::Single => RedisMode::Single,
            RedisType::Cluster => RedisMode::Cluster,
            RedisType::Sentinel => {
                if urls.len() < 2 {
                    anyhow::bail!(
                        "REDIS_TYPE=sentinel needs REDIS_URL as 'master-name,sentinel:port,...'"
                    );
                }
                RedisMode::Sentinel {
                    master: urls.remove(0),
                }
            }
        };
        Ok(RedisConfig {
            urls,
            mode,
            connections: self.redis_connections,
            batch: self.redis_batch,
            io_slice: Some(self.redis_io_slice).filter(|slice| !slice.is_zero()),
            connect_timeout: self.redis_connect_timeout,
            call_timeout: self.redis_timeout,
            wait: (self.redis_wait_replicas > 0).then_some(Wait {
                replicas: self.redis_wait_replicas,
                timeout: self.redis_wait_timeout,
            }),
            key_prefix: self.cache_key_prefix.clone(),
            key_layout: self.key_layout.into(),
            auth: self.redis_auth.clone().filter(|a| !a.is_empty()),
            tls_by_default: self.redis_tls,
            tls: RedisTls {
                ca: self.redis_tls_cacert.as_deref().map(read).transpose()?,
                client: match (&self.redis_tls_client_cert, &self.redis_tls_client_key) {
                    (Some(cert), Some(key)) => Some((read(cert)?, read(key)?)),
                    _ => None,
                },
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_serve;
    use super::*;

    fn config(args: &[&str]) -> anyhow::Result<RedisConfig> {
        parse_serve(args).unwrap().backend.redis.config()
    }

    /// Rows: REDIS_TYPE and REDIS_URL, then the addresses and mode they give.
    #[test]
    fn the_url_is_read_as_the_reference_reads_it() {
        let sentinel = |master: &str| RedisMode::Sentinel {
            master: master.into(),
        };
        for (kind, url, urls, mode) in [
            ("single", None, &[DEFAULT_REDIS_URL][..], RedisMode::Single),
            (
                "single",
                Some("127.0.0.1:1"),
                &["127.0.0.1:1"][..],
                RedisMode::Single,
            ),
            (
                "cluster",
                Some("127.0.0.1:1, 127.0.0.1:2,,"),
                &["127.0.0.1:1", "127.0.0.1:2"][..],
                RedisMode::Cluster,
            ),
            (
                "sentinel",
                Some("mymaster,127.0.0.1:1,127.0.0.1:2"),
                &["127.0.0.1:1", "127.0.0.1:2"][..],
                sentinel("mymaster"),
            ),
        ] {
            let mut args = vec!["--redis-type", kind];
            args.extend(url.iter().flat_map(|url| ["--redis-url", url]));
            let config = config(&args).unwrap();
            assert_eq!(config.urls, urls, "{args:?}");
            assert_eq!(config.mode, mode, "{args:?}");
        }
    }

    /// Rows: a command line that cannot give settings, and what its error names.
    #[test]
    fn bad_settings_are_named() {
        for (args, error) in [
            (
                &["--redis-type", "sentinel"][..],
                "REDIS_TYPE=sentinel needs",
            ),
            (
                &["--redis-type", "sentinel", "--redis-url", "mymaster"][..],
                "REDIS_TYPE=sentinel needs",
            ),
            (
                &["--redis-tls-cacert", "/nonexistent/ca.pem"][..],
                "cannot read /nonexistent/ca.pem",
            ),
        ] {
            let err = config(args).err().map(|e| format!("{e:#}"));
            assert!(
                err.as_deref().is_some_and(|e| e.contains(error)),
                "{args:?}: {err:?}"
            );
        }
    }

    #[test]
    fn the_other_settings_are_carried() {
        let defaults = config(&[]).unwrap();
        assert_eq!(defaults.io_slice, Some(Duration::from_micros(100)));
        assert_eq!(defaults.auth, None);
        assert_eq!(defaults.key_layout, KeyLayout::Turnstile);
        let set = config(&[
            "--redis-io-slice",
            "0",
            "--redis-auth",
            "",
            "--key-layout",
            "reference",
            "--cache-key-prefix",
            "p_",
            "--redis-connections",
            "3",
            "--redis-batch",
            "1",
            "--redis-timeout",
            "5ms",
            "--redis-tls",
        ])
        .unwrap();
        assert_eq!(set.io_slice, None, "0: the kernel's default");
        assert_eq!(set.auth, None, "an empty REDIS_AUTH is none");
        assert_eq!(set.key_layout, KeyLayout::Reference);
        assert_eq!(set.key_prefix, "p_");
        assert_eq!((set.connections, set.batch), (3, 1));
        assert_eq!(set.call_timeout, Duration::from_millis(5));
        assert!(set.tls_by_default);
        let auth = config(&["--redis-auth", "user:secret"]).unwrap().auth;
        assert_eq!(auth.as_deref(), Some("user:secret"));
    }

    /// Rows: the command line, and the wait for replicas it gives (0 replicas: none); a
    /// zero timeout is refused.
    #[test]
    fn the_wait_for_replicas_needs_one() {
        let wait = |replicas, ms| {
            Some(Wait {
                replicas,
                timeout: Duration::from_millis(ms),
            })
        };
        for (args, expected) in [
            (&[][..], None),
            (&["--redis-wait-timeout", "5ms"][..], None),
            (&["--redis-wait-replicas", "1"][..], wait(1, 10)),
            (
                &["--redis-wait-replicas", "2", "--redis-wait-timeout", "5ms"][..],
                wait(2, 5),
            ),
        ] {
            assert_eq!(config(args).unwrap().wait, expected, "{args:?}");
        }
        let err = parse_serve(&["--redis-wait-timeout", "0s"])
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("must be more than zero")),
            "{err:?}"
        );
    }

    /// The I/O thread's slice: 0 (the kernel's default), or what Linux takes (100 µs to
    /// 100 ms); anything else is refused with the range.
    #[test]
    fn the_io_slice_is_zero_or_what_linux_takes() {
        for (text, slice) in [
            ("0", Some(Duration::ZERO)),
            ("100us", Some(Duration::from_micros(100))),
            ("3ms", Some(Duration::from_millis(3))),
            ("100ms", Some(Duration::from_millis(100))),
            ("99us", None),
            ("101ms", None),
            ("soon", None),
        ] {
            match (parse_serve(&["--redis-io-slice", text]), slice) {
                (Ok(serve), Some(slice)) => {
                    assert_eq!(serve.backend.redis.redis_io_slice, slice, "{text}")
                }
                (Err(err), None) => assert!(
                    err.to_string().contains("100us to 100ms") || text == "soon",
                    "{text}: {err}"
                ),
                (result, _) => panic!("{text}: {:?}", result.map(|_| ())),
            }
        }
    }
}
