//! The command line. Every flag can also come from the environment; where the reference
//! server has a variable for the same setting, it has the same name (GRPC_PORT, PORT,
//! REDIS_URL, REDIS_TYPE, CACHE_KEY_PREFIX, SHADOW_MODE, LOG_LEVEL, ...).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::Source;
use crate::ops::telemetry::{LogFormat, TracingArgs};

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

#[derive(Debug, Args)]
pub struct RulesArgs {
    /// A rules file, or a directory whose *.yaml / *.yml files are loaded. Without it, the
    /// reference's layout is read: every file below RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/
    /// RUNTIME_APPDIRECTORY.
    #[arg(long, env = "TURNSTILE_CONFIG")]
    pub config: Option<PathBuf>,
    #[arg(
        long,
        env = "RUNTIME_ROOT",
        default_value = "/srv/runtime_data/current"
    )]
    pub runtime_root: PathBuf,
    #[arg(long, env = "RUNTIME_SUBDIRECTORY", default_value = "")]
    pub runtime_subdirectory: String,
    #[arg(long, env = "RUNTIME_APPDIRECTORY", default_value = "config")]
    pub runtime_appdirectory: String,
    /// Skip dotfiles and dot-directories in the runtime layout.
    #[arg(long, env = "RUNTIME_IGNOREDOTFILES")]
    pub runtime_ignoredotfiles: bool,
    /// Let one domain span several files (descriptors are merged; duplicates are errors).
    #[arg(long, env = "MERGE_DOMAIN_CONFIG")]
    pub merge_domain_config: bool,
}

impl RulesArgs {
    pub fn source(&self) -> Source {
        match &self.config {
            Some(path) => Source::path(path.clone(), self.merge_domain_config),
            None => Source::runtime(
                &self.runtime_root,
                &self.runtime_subdirectory,
                &self.runtime_appdirectory,
                self.runtime_ignoredotfiles,
                self.merge_domain_config,
            ),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConfigType {
    /// Rule files (--config or the runtime layout), reloaded when they change.
    #[value(name = "FILE")]
    File,
    /// Rules pushed by an xDS control plane (ADS, state of the world).
    #[value(name = "GRPC_XDS_SOTW")]
    GrpcXdsSotw,
}

/// Rules from a control plane, with the reference's settings (names and defaults).
#[derive(Debug, Args)]
pub struct XdsArgs {
    /// Where rules come from.
    #[arg(
        long,
        env = "CONFIG_TYPE",
        value_enum,
        ignore_case = true,
        default_value = "FILE"
    )]
    pub config_type: ConfigType,
    /// The node id the control plane keys its snapshots by.
    #[arg(long, env = "CONFIG_GRPC_XDS_NODE_ID", default_value = "default")]
    pub xds_node_id: String,
    /// Node metadata, `key=value,key2=value2`.
    #[arg(long, env = "CONFIG_GRPC_XDS_NODE_METADATA", default_value = "")]
    pub xds_node_metadata: String,
    /// The control plane: `host:port` or a URL.
    #[arg(
        long,
        env = "CONFIG_GRPC_XDS_SERVER_URL",
        default_value = "localhost:18000"
    )]
    pub xds_server_url: String,
    /// Wait between failed connection attempts (±50%).
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", value_parser = duration, default_value = "3s")]
    pub xds_connect_retry_interval: Duration,
    /// Headers sent on the stream, `key:value,key2:value2`.
    #[arg(
        long,
        env = "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
        default_value = "",
        hide_env_values = true
    )]
    pub xds_headers: String,
    /// Connect to the control plane with TLS.
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_USE_TLS")]
    pub xds_tls: bool,
    /// PEM client certificate for mTLS to the control plane.
    #[arg(
        long,
        env = "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
        requires = "xds_tls_key"
    )]
    pub xds_tls_cert: Option<PathBuf>,
    #[arg(
        long,
        env = "CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
        requires = "xds_tls_cert"
    )]
    pub xds_tls_key: Option<PathBuf>,
    /// PEM CA that signed the control plane's certificate (default: the public roots).
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_TLS_CACERT")]
    pub xds_tls_cacert: Option<PathBuf>,
    /// The name to verify in the control plane's certificate, when not the URL's host.
    #[arg(long, env = "CONFIG_GRPC_XDS_SERVER_TLS_SAN")]
    pub xds_tls_san: Option<String>,
    /// Largest xDS response accepted (default: gRPC's 4 MiB).
    #[arg(long, env = "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES")]
    pub xds_max_message_bytes: Option<usize>,
    /// First wait before reconnecting after the stream broke; it doubles up to the maximum.
    #[arg(long, env = "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", value_parser = duration, default_value = "10s")]
    pub xds_backoff_initial: Duration,
    #[arg(long, env = "XDS_CLIENT_BACKOFF_MAX_INTERVAL", value_parser = duration, default_value = "60s")]
    pub xds_backoff_max: Duration,
    /// Each wait is randomized by up to this share, either way (with jitter on).
    #[arg(long, env = "XDS_CLIENT_BACKOFF_RANDOM_FACTOR", default_value_t = 0.5)]
    pub xds_backoff_random_factor: f64,
    #[arg(long, env = "XDS_CLIENT_BACKOFF_JITTER", default_value_t = true, action = clap::ArgAction::Set)]
    pub xds_backoff_jitter: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// State in this process: exact for one instance, no Redis needed.
    Memory,
    /// State in Redis, shared by every instance.
    Redis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RedisType {
    Single,
    Sentinel,
    Cluster,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ChargingArg {
    /// A refused request charges none of its descriptors.
    Atomic,
    /// Each admitted descriptor is charged even when another refuses (the reference).
    PerDescriptor,
}

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KeyLayoutArg {
    Turnstile,
    Reference,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HeadersArg {
    Off,
    /// RateLimit-Limit / -Remaining / -Reset, as the reference.
    Legacy,
    /// RateLimit-Policy and RateLimit (IETF draft).
    Ietf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum MetadataArg {
    /// Answers where a limit said no (OVER_LIMIT, or let through by shadow mode).
    Refusals,
    /// Every answer (`true`, the setting's old boolean, means this).
    #[value(alias = "true")]
    All,
    #[value(alias = "false")]
    Off,
}

fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| e.to_string())
}

/// A duration above zero: a connection's timers (zero would ping, or close, at once).
fn positive_duration(text: &str) -> Result<Duration, String> {
    match duration(text)? {
        zero if zero.is_zero() => Err(format!("{text}: must be more than zero")),
        positive => Ok(positive),
    }
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

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub rules: RulesArgs,
    #[command(flatten)]
    pub xds: XdsArgs,
    #[command(flatten)]
    pub tracing: TracingArgs,

    /// Debug listen host (serves /rlconfig, as the reference's debug port).
    #[arg(long, env = "DEBUG_HOST", default_value = "0.0.0.0")]
    pub debug_host: IpAddr,
    /// Debug listen port; 0 picks a free one.
    #[arg(long, env = "DEBUG_PORT", default_value_t = 6070)]
    pub debug_port: u16,
    /// Debug listen address; overrides --debug-host and --debug-port.
    #[arg(long, env = "TURNSTILE_DEBUG_ADDR")]
    pub debug_addr: Option<SocketAddr>,
    /// Do not open the debug port.
    #[arg(long, env = "TURNSTILE_NO_DEBUG_PORT")]
    pub no_debug_port: bool,
    /// Also export the reference's stats to statsd (UDP), as counters.
    #[arg(long, env = "USE_STATSD")]
    pub use_statsd: bool,
    #[arg(long, env = "STATSD_HOST", default_value = "localhost")]
    pub statsd_host: String,
    #[arg(long, env = "STATSD_PORT", default_value_t = 8125)]
    pub statsd_port: u16,
    /// How often stats are sent to statsd.
    #[arg(long, env = "STATS_FLUSH_INTERVAL", value_parser = duration, default_value = "10s")]
    pub stats_flush_interval: Duration,
    /// Also serve Prometheus metrics on a port of their own (PROMETHEUS_ADDR).
    #[arg(long, env = "USE_PROMETHEUS")]
    pub use_prometheus: bool,
    /// Prometheus listen address, in the reference's form (":9090" is every interface).
    #[arg(long, env = "PROMETHEUS_ADDR", default_value = ":9090")]
    pub prometheus_addr: String,
    #[arg(long, env = "PROMETHEUS_PATH", default_value = "/metrics")]
    pub prometheus_path: String,
    /// A statsd_exporter mapping file for the reference's stats, in place of its built-in
    /// mapping (Envoy Gateway mounts one). A file that does not load stops the start.
    #[arg(long, env = "PROMETHEUS_MAPPER_YAML")]
    pub prometheus_mapper_yaml: Option<PathBuf>,
    /// Keep the built-in mapping's response time in milliseconds, as older releases of the
    /// reference exported it.
    #[arg(long, env = "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS")]
    pub prometheus_response_time_as_milliseconds: bool,

    /// Poll the rules at this period instead of watching them with inotify (for file
    /// systems without change events). Either way, SIGHUP forces a reload.
    #[arg(long, env = "TURNSTILE_CONFIG_POLL_INTERVAL", value_parser = duration)]
    pub config_poll_interval: Option<Duration>,

    /// gRPC listen host.
    #[arg(long, env = "GRPC_HOST", default_value = "0.0.0.0")]
    pub grpc_host: IpAddr,
    /// gRPC listen port.
    #[arg(long, env = "GRPC_PORT", default_value_t = 8081)]
    pub grpc_port: u16,
    /// gRPC listen address; overrides --grpc-host and --grpc-port.
    #[arg(long, env = "TURNSTILE_GRPC_ADDR")]
    pub grpc_addr: Option<SocketAddr>,

    /// Serve gRPC over TLS (with --grpc-tls-cert and --grpc-tls-key).
    #[arg(long, env = "GRPC_SERVER_USE_TLS")]
    pub grpc_tls: bool,
    /// PEM certificate chain for gRPC TLS.
    #[arg(long, env = "GRPC_SERVER_TLS_CERT", requires = "grpc_tls_key")]
    pub grpc_tls_cert: Option<PathBuf>,
    /// PEM private key for gRPC TLS.
    #[arg(long, env = "GRPC_SERVER_TLS_KEY", requires = "grpc_tls_cert")]
    pub grpc_tls_key: Option<PathBuf>,
    /// PEM CA bundle: when set, clients must present a certificate it signed (mTLS).
    #[arg(long, env = "GRPC_CLIENT_TLS_CACERT", requires = "grpc_tls_cert")]
    pub grpc_client_ca: Option<PathBuf>,
    /// Threads serving gRPC, each with the connections it was given (0: one per CPU, less one
    /// on the Redis backend). A connection stays on one thread, and the thread does its own
    /// Redis I/O, so a call wakes no other thread.
    #[arg(long, env = "TURNSTILE_GRPC_THREADS", default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=1024))]
    pub grpc_threads: u16,
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
    /// Most streams (calls) one gRPC connection may have open at once, advertised to the
    /// client (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); a client that opens more has them
    /// refused, and an HTTP/2 client such as Envoy opens another connection instead.
    #[arg(long, env = "TURNSTILE_GRPC_MAX_STREAMS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub grpc_max_streams: u32,
    /// Largest gRPC request accepted, in bytes.
    #[arg(long, env = "TURNSTILE_MAX_MESSAGE_BYTES", default_value_t = 1 << 20)]
    pub max_message_bytes: usize,
    /// Bound on a whole call, whatever it waits for.
    #[arg(long, env = "TURNSTILE_REQUEST_TIMEOUT", value_parser = duration, default_value = "1s")]
    pub request_timeout: Duration,
    /// Most open gRPC connections. At it, a new connection from a peer holding fewer than the
    /// biggest peer takes the place of one of that peer's connections (in its handshake, or
    /// idle); otherwise it is closed at accept. Lowered at start-up when the open-files limit
    /// would not hold them all.
    #[arg(long, env = "TURNSTILE_GRPC_MAX_CONNECTIONS", default_value_t = 10_000)]
    pub grpc_max_connections: usize,
    /// Most open gRPC connections from one peer (an IPv4 address, or an IPv6 /64); past it
    /// its new ones are closed at accept, so one client cannot hold every connection. Never
    /// more than half of --grpc-max-connections (as fitted to the open-files limit). Envoy
    /// opens a few per worker thread.
    #[arg(long, env = "TURNSTILE_GRPC_MAX_CONNECTIONS_PER_PEER", default_value_t = 1_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub grpc_max_connections_per_peer: usize,
    /// A gRPC connection that has not finished TLS and sent the HTTP/2 preface by then is
    /// closed.
    #[arg(long, env = "TURNSTILE_GRPC_HANDSHAKE_TIMEOUT", value_parser = duration, default_value = "10s")]
    pub grpc_handshake_timeout: Duration,
    /// A gRPC connection silent this long is sent an HTTP/2 ping: idle clients that answer
    /// (Envoy's long-lived connections) stay, dead peers are found.
    #[arg(long, env = "TURNSTILE_GRPC_KEEPALIVE_INTERVAL", value_parser = positive_duration, default_value = "60s")]
    pub grpc_keepalive_interval: Duration,
    /// A connection whose ping is not answered within this is closed.
    #[arg(long, env = "TURNSTILE_GRPC_KEEPALIVE_TIMEOUT", value_parser = positive_duration, default_value = "20s")]
    pub grpc_keepalive_timeout: Duration,
    /// A gRPC connection this old (give or take a tenth, so that connections opened together
    /// do not all end together) is asked to close (HTTP/2 GOAWAY): its client opens a new
    /// one, which a load balancer may send to another instance, so a fleet that grew gets
    /// its share of long-lived connections.
    #[arg(long, env = "GRPC_MAX_CONNECTION_AGE", value_parser = positive_duration, default_value = "24h")]
    pub grpc_max_connection_age: Duration,
    /// How long a connection asked to close may still finish its calls before it is closed.
    #[arg(long, env = "GRPC_MAX_CONNECTION_AGE_GRACE", value_parser = positive_duration, default_value = "1h")]
    pub grpc_max_connection_age_grace: Duration,

    /// Admin HTTP listen host.
    #[arg(long, env = "HOST", default_value = "0.0.0.0")]
    pub http_host: IpAddr,
    /// Admin HTTP listen port.
    #[arg(long, env = "PORT", default_value_t = 8080)]
    pub http_port: u16,
    /// Admin HTTP listen address; overrides --http-host and --http-port.
    #[arg(long, env = "TURNSTILE_HTTP_ADDR")]
    pub http_addr: Option<SocketAddr>,
    /// Most open connections on each admin HTTP port (main, debug, Prometheus); past it new
    /// ones are closed at accept.
    #[arg(long, env = "TURNSTILE_HTTP_MAX_CONNECTIONS", default_value_t = 64)]
    pub http_max_connections: usize,
    /// Bound on reading a request's headers (and on an idle keep-alive connection), on
    /// reading its body and answering it, and on a write making no progress.
    #[arg(long, env = "TURNSTILE_HTTP_READ_TIMEOUT", value_parser = duration, default_value = "10s")]
    pub http_read_timeout: Duration,

    /// Where limit state lives. Default: memory, or redis when a Redis URL is given.
    #[arg(long, env = "BACKEND_TYPE", value_enum, ignore_case = true)]
    pub backend: Option<BackendKind>,

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
    /// Refusals remembered locally, so a key over its limit is refused without a round trip
    /// until its reset (0 disables). Never admits anything the backend would refuse.
    #[arg(long, env = "TURNSTILE_LOCAL_CACHE_ENTRIES", default_value_t = 100_000)]
    pub local_cache_entries: usize,
    /// The reference's local cache size; when set, it sizes the cache instead (one entry per
    /// 256 bytes; 0 disables it).
    #[arg(long, env = "LOCAL_CACHE_SIZE_IN_BYTES")]
    pub local_cache_size_in_bytes: Option<usize>,
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

    /// What a refused request costs its other descriptors.
    #[arg(long, env = "TURNSTILE_CHARGING", value_enum, default_value = "atomic")]
    pub charging: ChargingArg,
    /// Rate-limit headers in answers.
    #[arg(
        long,
        env = "TURNSTILE_RESPONSE_HEADERS",
        value_enum,
        default_value = "off"
    )]
    pub response_headers: HeadersArg,
    /// The reference's switch for its headers: same as --response-headers legacy.
    #[arg(long, env = "LIMIT_RESPONSE_HEADERS_ENABLED")]
    pub limit_response_headers_enabled: bool,
    #[arg(long, env = "LIMIT_LIMIT_HEADER", default_value = "RateLimit-Limit")]
    pub limit_limit_header: String,
    #[arg(
        long,
        env = "LIMIT_REMAINING_HEADER",
        default_value = "RateLimit-Remaining"
    )]
    pub limit_remaining_header: String,
    #[arg(long, env = "LIMIT_RESET_HEADER", default_value = "RateLimit-Reset")]
    pub limit_reset_header: String,
    /// Which answers carry dynamic_metadata naming the deciding rule, its algorithm and the
    /// outcome.
    #[arg(
        long,
        env = "TURNSTILE_RESPONSE_METADATA",
        value_enum,
        default_value = "refusals"
    )]
    pub response_metadata: MetadataArg,
    /// The reference's dynamic metadata instead: the request echoed and the `metadata` of the
    /// rules that passed (plus the deciding rule's name, algorithm and outcome).
    #[arg(long, env = "RESPONSE_DYNAMIC_METADATA")]
    pub response_dynamic_metadata: bool,
    /// Every limit is soft (the reference's QUOTA_MODE): a request is refused only when all
    /// of its limits are over.
    #[arg(long, env = "QUOTA_MODE")]
    pub quota_mode: bool,
    /// Answer OK even when over a limit (statuses still say OVER_LIMIT).
    #[arg(long, env = "SHADOW_MODE")]
    pub shadow_mode: bool,
    /// Share of a limit past which hits count as near_limit in metrics.
    #[arg(long, env = "NEAR_LIMIT_RATIO", default_value_t = 0.8)]
    pub near_limit_ratio: f64,

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
    /// Most live keys the memory backend holds; a new key past it evicts one seldom used.
    #[arg(long, env = "TURNSTILE_MEMORY_MAX_KEYS", default_value_t = crate::backend::memory::DEFAULT_MAX_KEYS)]
    pub memory_max_keys: usize,
    /// Most bytes the memory backend's live keys take (keys and per-key state, as counted).
    #[arg(long, env = "TURNSTILE_MEMORY_MAX_BYTES", default_value_t = crate::backend::memory::DEFAULT_MAX_BYTES)]
    pub memory_max_bytes: usize,
    /// Most metric series whose labels come from requests (detailed_metric values, override
    /// keys, unknown domains).
    #[arg(long, env = "TURNSTILE_MAX_SERIES", default_value_t = crate::ops::metrics::DEFAULT_MAX_SERIES)]
    pub max_series: usize,
    /// Most bytes those series take (their labels, as often as they are kept, and a fixed
    /// cost per counter); configured rules' series are outside this budget.
    #[arg(long, env = "TURNSTILE_MAX_SERIES_BYTES", default_value_t = crate::ops::metrics::DEFAULT_MAX_SERIES_BYTES)]
    pub max_series_bytes: usize,

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

    /// Report not-serving while the rules define no domain.
    #[arg(long, env = "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED")]
    pub healthy_with_at_least_one_config_loaded: bool,
    /// How long a shutdown waits for in-flight calls and open connections.
    #[arg(long, env = "TURNSTILE_SHUTDOWN_GRACE", value_parser = duration, default_value = "10s")]
    pub shutdown_grace: Duration,

    /// trace, debug, info, warn or error (or a tracing filter directive).
    #[arg(long, env = "LOG_LEVEL", default_value = "info")]
    pub log_level: String,
    #[arg(
        long,
        env = "LOG_FORMAT",
        value_enum,
        ignore_case = true,
        default_value = "text"
    )]
    pub log_format: LogFormat,
}

impl ServeArgs {
    /// The backend that decides: as named, else Redis if a Redis URL is given (the
    /// reference's default backend is Redis: a deployment that names a Redis and no backend
    /// keeps using it), else memory.
    pub fn backend_kind(&self) -> BackendKind {
        self.backend.unwrap_or(if self.redis_url.is_some() {
            BackendKind::Redis
        } else {
            BackendKind::Memory
        })
    }

    /// How many threads serve gRPC: as many as asked, else one per CPU, less one on the Redis
    /// backend. Each thread does its own Redis I/O, but a thread per CPU leaves no CPU to
    /// wait for Redis on: measured with Redis and the load generator sharing 2 CPUs, 2
    /// threads served 21 % fewer decisions/s than 1, at 29 % more CPU per call (BENCHMARKS.md).
    pub fn grpc_threads(&self) -> usize {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        match (self.grpc_threads, self.backend_kind()) {
            (0, BackendKind::Memory) => cpus,
            (0, BackendKind::Redis) => cpus.saturating_sub(1).max(1),
            (n, _) => usize::from(n),
        }
    }

    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
            .unwrap_or(SocketAddr::new(self.grpc_host, self.grpc_port))
    }

    pub fn debug_addr(&self) -> Option<SocketAddr> {
        (!self.no_debug_port).then(|| {
            self.debug_addr
                .unwrap_or(SocketAddr::new(self.debug_host, self.debug_port))
        })
    }

    /// PROMETHEUS_ADDR as Go writes it: `host:port`, or `:port` for every interface.
    pub fn prometheus_addr(&self) -> anyhow::Result<SocketAddr> {
        let addr = match self.prometheus_addr.strip_prefix(':') {
            Some(port) => format!("0.0.0.0:{port}"),
            None => self.prometheus_addr.clone(),
        };
        addr.parse()
            .map_err(|e| anyhow::anyhow!("PROMETHEUS_ADDR '{}': {e}", self.prometheus_addr))
    }

    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
            .unwrap_or(SocketAddr::new(self.http_host, self.http_port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn serve(args: &[&str]) -> Box<ServeArgs> {
        let line = ["turnstile", "serve"].iter().chain(args).copied();
        match Cli::try_parse_from(line).unwrap().command {
            Command::Serve(serve) => serve,
            _ => unreachable!("a serve command line"),
        }
    }

    #[test]
    fn serving_threads_leave_the_redis_backend_a_cpu() {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        for (args, threads) in [
            (&[][..], cpus),
            (&["--backend", "memory"][..], cpus),
            (&["--backend", "redis"][..], cpus.saturating_sub(1).max(1)),
            (
                &["--redis-url", "redis://127.0.0.1:1"][..],
                cpus.saturating_sub(1).max(1),
            ),
            (&["--backend", "redis", "--grpc-threads", "3"][..], 3),
            (&["--grpc-threads", "1"][..], 1),
        ] {
            assert_eq!(serve(args).grpc_threads(), threads, "{args:?}");
        }
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
            let line = ["turnstile", "serve", "--redis-io-slice", text];
            match (Cli::try_parse_from(line), slice) {
                (Ok(cli), Some(slice)) => match cli.command {
                    Command::Serve(serve) => assert_eq!(serve.redis_io_slice, slice, "{text}"),
                    _ => unreachable!("a serve command line"),
                },
                (Err(err), None) => assert!(
                    err.to_string().contains("100us to 100ms") || text == "soon",
                    "{text}: {err}"
                ),
                (result, _) => panic!("{text}: {:?}", result.map(|_| ())),
            }
        }
        assert_eq!(serve(&[]).redis_io_slice, Duration::from_micros(100));
    }

    /// A gRPC connection's timers take any duration above zero, and refuse zero by name; the
    /// maximum age and its grace default to the reference's (24 h, 1 h).
    #[test]
    fn a_connections_timers_are_above_zero() {
        let flags = [
            "--grpc-keepalive-interval",
            "--grpc-keepalive-timeout",
            "--grpc-max-connection-age",
            "--grpc-max-connection-age-grace",
        ];
        for flag in flags {
            let line = |text| ["turnstile", "serve", flag, text];
            let err = Cli::try_parse_from(line("0s")).err().map(|e| e.to_string());
            assert!(
                err.as_deref()
                    .is_some_and(|e| e.contains("must be more than zero")),
                "{flag} 0s: {err:?}"
            );
            assert!(Cli::try_parse_from(line("1ms")).is_ok(), "{flag} 1ms");
        }
        let defaults = serve(&[]);
        assert_eq!(
            defaults.grpc_max_connection_age,
            Duration::from_secs(86_400)
        );
        assert_eq!(
            defaults.grpc_max_connection_age_grace,
            Duration::from_secs(3_600)
        );
    }
}
