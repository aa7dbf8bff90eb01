//! What turnstile tells its operators: logs, traces (their flags are defined beside the
//! exporter, in `ops::telemetry`), Prometheus metrics (and their bounds), and the
//! reference's stats over statsd.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::duration;
use crate::ops::mapper::Mapper;
use crate::ops::metrics::SeriesBudget;
use crate::ops::telemetry::{LogFormat, TracingArgs};

#[derive(Debug, Args)]
#[command(next_help_heading = "Logs and metrics")]
pub struct ObservabilityArgs {
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
    #[command(flatten)]
    pub tracing: TracingArgs,

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
    /// Share of a limit past which hits count as near_limit in metrics.
    #[arg(long, env = "NEAR_LIMIT_RATIO", default_value_t = 0.8)]
    pub near_limit_ratio: f64,
    /// Most metric series whose labels come from requests (detailed_metric values, override
    /// keys, unknown domains).
    #[arg(long, env = "TURNSTILE_MAX_SERIES", default_value_t = crate::ops::metrics::DEFAULT_MAX_SERIES)]
    pub max_series: usize,
    /// Most bytes those series take (their labels, as often as they are kept, and a fixed
    /// cost per counter); configured rules' series are outside this budget.
    #[arg(long, env = "TURNSTILE_MAX_SERIES_BYTES", default_value_t = crate::ops::metrics::DEFAULT_MAX_SERIES_BYTES)]
    pub max_series_bytes: usize,

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
}

impl ObservabilityArgs {
    /// PROMETHEUS_ADDR as Go writes it: `host:port`, or `:port` for every interface.
    pub fn prometheus_addr(&self) -> anyhow::Result<SocketAddr> {
        let addr = match self.prometheus_addr.strip_prefix(':') {
            Some(port) => format!("0.0.0.0:{port}"),
            None => self.prometheus_addr.clone(),
        };
        addr.parse()
            .map_err(|e| anyhow::anyhow!("PROMETHEUS_ADDR '{}': {e}", self.prometheus_addr))
    }

    /// The mapping of the reference's stats: PROMETHEUS_MAPPER_YAML's, else the built-in one.
    pub fn stats_mapper(&self) -> anyhow::Result<Mapper> {
        let Some(path) = &self.prometheus_mapper_yaml else {
            return Ok(Mapper::reference_default(
                self.prometheus_response_time_as_milliseconds,
            ));
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("PROMETHEUS_MAPPER_YAML {}: {e}", path.display()))?;
        Mapper::from_yaml(&text)
            .map_err(|e| anyhow::anyhow!("PROMETHEUS_MAPPER_YAML {}: {e}", path.display()))
    }

    /// The bounds on series whose labels come from requests.
    pub fn series_budget(&self) -> SeriesBudget {
        SeriesBudget {
            max_series: self.max_series,
            max_bytes: self.max_series_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::parse_serve;

    /// Rows: PROMETHEUS_ADDR, and the address it means (None: refused, naming the setting).
    #[test]
    fn the_prometheus_address_in_gos_form() {
        for (text, addr) in [
            (":9090", Some("0.0.0.0:9090")),
            ("127.0.0.2:1", Some("127.0.0.2:1")),
            ("9090", None),
            ("localhost:9090", None),
        ] {
            let observability = parse_serve(&["--prometheus-addr", text])
                .unwrap()
                .observability;
            match (observability.prometheus_addr(), addr) {
                (Ok(parsed), Some(addr)) => assert_eq!(parsed.to_string(), addr, "{text}"),
                (Err(e), None) => assert!(e.to_string().contains("PROMETHEUS_ADDR"), "{text}: {e}"),
                (result, _) => panic!("{text}: {result:?}"),
            }
        }
    }

    /// The built-in mapping unless a file is named; a file that does not load is an error
    /// that names the setting and the file.
    #[test]
    fn the_stats_mapping_from_the_file_or_built_in() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, "mappings: [\n").unwrap();
        let missing = dir.path().join("missing.yaml");
        for (file, error) in [
            (None, None),
            (Some(&bad), Some("PROMETHEUS_MAPPER_YAML")),
            (Some(&missing), Some("missing.yaml")),
        ] {
            let mut args = vec!["--prometheus-response-time-as-milliseconds"];
            args.extend(
                file.iter()
                    .flat_map(|f| ["--prometheus-mapper-yaml", f.to_str().unwrap()]),
            );
            let mapper = parse_serve(&args).unwrap().observability.stats_mapper();
            match (mapper.err(), error) {
                (None, None) => {}
                (Some(e), Some(error)) => assert!(e.to_string().contains(error), "{file:?}: {e}"),
                (e, _) => panic!("{file:?}: {e:?}"),
            }
        }
    }
}
