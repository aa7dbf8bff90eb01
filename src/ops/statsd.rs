//! statsd export under the reference's stat names, for dashboards that read statsd.
//!
//! A `metrics` recorder beside the Prometheus one: every counter the service registers whose
//! name the reference also has gets a cell here under the reference's dotted name
//! (`ratelimit.service.rate_limit.<domain>.<key>.total_hits`, ...). A task sends the cells'
//! increments since the last flush as statsd counters (`name:delta|c`) over UDP, every
//! STATS_FLUSH_INTERVAL.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use metrics::{
    Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use tokio::net::UdpSocket;

/// Lines per datagram are kept under a common MTU.
const MAX_DATAGRAM: usize = 1_400;

#[derive(Default)]
struct Cell(AtomicU64);

impl CounterFn for Cell {
    fn increment(&self, value: u64) {
        self.0.fetch_add(value, Ordering::Relaxed);
    }

    fn absolute(&self, value: u64) {
        self.0.fetch_max(value, Ordering::Relaxed);
    }
}

/// The counters to flush, by statsd name.
#[derive(Clone, Default)]
pub struct StatsdRecorder {
    cells: Arc<Mutex<BTreeMap<String, Arc<Cell>>>>,
}

fn label<'k>(key: &'k Key, name: &str) -> &'k str {
    key.labels()
        .find(|l| l.key() == name)
        .map_or("", |l| l.value())
}

/// The reference's name for one of our series, if it has one.
fn statsd_name(key: &Key) -> Option<String> {
    let name = key.name();
    if let Some(stat) = name.strip_prefix("ratelimit_service_rate_limit_") {
        let (domain, rule) = (label(key, "domain"), label(key, "key"));
        return match stat {
            "domain_not_found" => Some(format!(
                "ratelimit.service.rate_limit.{domain}.domain_not_found"
            )),
            "total_hits" | "over_limit" | "near_limit" | "within_limit" | "shadow_mode" => Some(
                format!("ratelimit.service.rate_limit.{domain}.{rule}.{stat}"),
            ),
            _ => None,
        };
    }
    match name {
        "ratelimit_service_config_load_success" => {
            Some("ratelimit.service.config_load_success".into())
        }
        "ratelimit_service_config_load_error" => Some("ratelimit.service.config_load_error".into()),
        "ratelimit_service_global_shadow_mode" => {
            Some("ratelimit.service.global_shadow_mode".into())
        }
        "ratelimit_service_should_rate_limit_error" => Some(
            match label(key, "err_type") {
                "invalid_argument" => "ratelimit.service.call.should_rate_limit.service_error",
                _ => "ratelimit.service.call.should_rate_limit.redis_error",
            }
            .into(),
        ),
        "ratelimit_service_total_requests" => Some(format!(
            "ratelimit_server.{}.total_requests",
            label(key, "grpc_method")
        )),
        _ => None,
    }
}

impl Recorder for StatsdRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let Some(name) = statsd_name(key) else {
            return Counter::noop();
        };
        let mut cells = self.cells.lock().unwrap_or_else(PoisonError::into_inner);
        Counter::from_arc(cells.entry(name).or_default().clone())
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

impl StatsdRecorder {
    /// The increments since the last call, as statsd lines.
    fn drain(&self) -> Vec<String> {
        let cells = self.cells.lock().unwrap_or_else(PoisonError::into_inner);
        cells
            .iter()
            .filter_map(|(name, cell)| {
                let delta = cell.0.swap(0, Ordering::Relaxed);
                (delta > 0).then(|| format!("{name}:{delta}|c"))
            })
            .collect()
    }

    /// Send the increments to `target` every `interval`, forever.
    pub async fn flush_to(self, target: SocketAddr, interval: Duration) {
        let bind: SocketAddr = if target.is_ipv4() {
            ([0, 0, 0, 0], 0).into()
        } else {
            ([0u16; 8], 0).into()
        };
        let socket = match UdpSocket::bind(bind).await {
            Ok(socket) => socket,
            Err(error) => {
                tracing::error!(%error, "statsd export disabled: cannot open a UDP socket");
                return;
            }
        };
        let mut tick = tokio::time::interval(interval);
        loop {
            tick.tick().await;
            for datagram in datagrams(self.drain()) {
                if let Err(error) = socket.send_to(datagram.as_bytes(), target).await {
                    tracing::debug!(%error, %target, "statsd send failed");
                }
            }
        }
    }
}

/// Lines packed into datagrams of at most MAX_DATAGRAM bytes (a longer line goes alone).
fn datagrams(lines: Vec<String>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in lines {
        match out.last_mut() {
            Some(last) if last.len() + 1 + line.len() <= MAX_DATAGRAM => {
                last.push('\n');
                last.push_str(&line);
            }
            _ => out.push(line),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrics::Label;

    #[test]
    fn series_get_the_reference_names_and_flush_as_deltas() {
        let statsd = StatsdRecorder::default();
        let meta = Metadata::new("t", metrics::Level::INFO, None);
        let rule = Key::from_parts(
            "ratelimit_service_rate_limit_total_hits",
            vec![Label::new("domain", "d"), Label::new("key", "k_v.sub")],
        );
        statsd.register_counter(&rule, &meta).increment(3);
        let errors = Key::from_parts(
            "ratelimit_service_should_rate_limit_error",
            vec![Label::new("err_type", "backend_timeout")],
        );
        statsd.register_counter(&errors, &meta).increment(1);
        let ignored = Key::from_name("turnstile_backend_fallback_answers");
        statsd.register_counter(&ignored, &meta).increment(1);
        assert_eq!(
            statsd.drain(),
            [
                "ratelimit.service.call.should_rate_limit.redis_error:1|c",
                "ratelimit.service.rate_limit.d.k_v.sub.total_hits:3|c",
            ]
        );
        assert!(
            statsd.drain().is_empty(),
            "only what changed since the last flush"
        );
    }

    #[test]
    fn datagrams_stay_under_the_mtu() {
        let lines: Vec<String> = (0..100)
            .map(|i| format!("ratelimit.service.x{i}:1|c"))
            .collect();
        let packed = datagrams(lines);
        assert!(packed.len() > 1);
        assert!(packed.iter().all(|d| d.len() <= MAX_DATAGRAM));
        assert_eq!(packed.iter().map(|d| d.lines().count()).sum::<usize>(), 100);
    }
}
