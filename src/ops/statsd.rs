//! statsd export under the reference's stat names, for dashboards that read statsd.
//!
//! Every reference stat (see `stats`) counts into a cell here under its dotted name
//! (`ratelimit.service.rate_limit.<domain>.<key>.total_hits`, ...). A task sends the cells'
//! increments since the last flush as statsd counters (`name:delta|c`) over UDP, every
//! STATS_FLUSH_INTERVAL.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use metrics::{Counter, CounterFn};
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

impl StatsdRecorder {
    /// The cell of the counter named `name`, made on first use.
    pub fn counter(&self, name: &str) -> Counter {
        let mut cells = self.cells.lock().unwrap_or_else(PoisonError::into_inner);
        let cell = match cells.get(name) {
            Some(cell) => Arc::clone(cell),
            None => Arc::clone(cells.entry(name.to_owned()).or_default()),
        };
        Counter::from_arc(cell)
    }

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

    #[test]
    fn counters_flush_as_deltas() {
        let statsd = StatsdRecorder::default();
        statsd
            .counter("ratelimit.service.rate_limit.d.k_v.sub.total_hits")
            .increment(3);
        statsd
            .counter("ratelimit.service.call.should_rate_limit.redis_error")
            .increment(1);
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
