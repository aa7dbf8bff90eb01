//! What Redis does with turnstile's keys once it is full, read from its own settings.
//!
//! Keys are named after what clients send, so a flood of new descriptor values fills Redis.
//! Under `noeviction` (Redis' default) every script is then refused and every decision gets
//! the failure policy's answer; under an LRU or LFU policy the flood's keys go first and
//! deciding goes on (every key has a TTL, so `volatile-` policies reach them all). turnstile
//! never changes Redis' settings: it reads them at connect and every minute, logs changes,
//! and shows them in `turnstile_redis_evicts_when_full`.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use ::redis::{FromRedisValue, Value};

use super::Shared;
use super::threads::io;
use crate::ops::metrics::Metrics;

/// 1 when every master evicts once full; 0 when one refuses writes then or has no bound; not
/// exported until a master's settings are read.
const GAUGE: &str = "turnstile_redis_evicts_when_full";

/// How often the settings are read again.
const PERIOD: Duration = Duration::from_secs(60);

/// Bound on reading them (not a decision: no breaker, no policy).
const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// What one master does once full.
#[derive(Clone, Debug, PartialEq, Eq)]
enum WhenFull {
    /// It evicts keys by this policy.
    Evicts(String),
    /// `noeviction`: it refuses every write, and so every decision.
    Refuses,
    /// No `maxmemory`: nothing stops it growing.
    Unbounded,
    /// Its settings could not be read (`CONFIG` renamed or refused, as managed services do).
    Unknown(String),
}

impl WhenFull {
    /// From a master's reply to `CONFIG GET maxmemory*` (or the error in its place).
    fn read(reply: Value) -> WhenFull {
        let settings = match HashMap::<String, String>::from_redis_value(reply) {
            Ok(settings) => settings,
            Err(err) => return WhenFull::Unknown(err.to_string()),
        };
        let bound = settings
            .get("maxmemory")
            .and_then(|v| v.parse::<u64>().ok());
        match (bound, settings.get("maxmemory-policy")) {
            (Some(0), Some(_)) => WhenFull::Unbounded,
            (Some(_), Some(policy)) if policy == "noeviction" => WhenFull::Refuses,
            (Some(_), Some(policy)) => WhenFull::Evicts(policy.clone()),
            _ => WhenFull::Unknown(format!("no maxmemory settings in {settings:?}")),
        }
    }

    /// Say what changed, at the level it deserves.
    fn log(&self, master: &str) {
        let redis = if master.is_empty() {
            "Redis".to_owned()
        } else {
            format!("Redis master {master}")
        };
        match self {
            WhenFull::Evicts(policy) => {
                tracing::info!("{redis} evicts keys once full (maxmemory-policy {policy})")
            }
            WhenFull::Refuses => tracing::warn!(
                "{redis} refuses every write once full (maxmemory-policy noeviction): then every decision fails and gets the failure policy's answer, and a client sending new descriptor values can fill it; set maxmemory-policy volatile-lru (every key turnstile writes has a TTL)"
            ),
            WhenFull::Unbounded => tracing::warn!(
                "{redis} has no maxmemory: a client sending new descriptor values grows it until its host runs out of memory; set maxmemory, and maxmemory-policy volatile-lru"
            ),
            WhenFull::Unknown(why) => tracing::info!(
                "cannot read what {redis} does once full ({why}): make sure it has a maxmemory and a maxmemory-policy that evicts, such as volatile-lru"
            ),
        }
    }
}

/// The gauge's value for these masters' settings, if any was read.
fn gauge_value<'a>(masters: impl IntoIterator<Item = &'a WhenFull>) -> Option<f64> {
    let mut value = None;
    for master in masters {
        match master {
            WhenFull::Refuses | WhenFull::Unbounded => return Some(0.0),
            WhenFull::Evicts(_) => value = Some(1.0),
            WhenFull::Unknown(_) => {}
        }
    }
    value
}

/// Read the masters' settings now and every `PERIOD` on the I/O runtime, for as long as the
/// backend lives.
pub(super) fn watch(shared: Weak<Shared>, metrics: Arc<Metrics>) {
    io().spawn(async move {
        let mut known: HashMap<String, WhenFull> = HashMap::new();
        loop {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let read = tokio::time::timeout(READ_TIMEOUT, shared.pool.every_master(config_get()));
            let read = read.await;
            drop(shared);
            // Redis away: the decisions say so, and nothing new is known here.
            if let Ok(Ok(replies)) = read {
                let masters: HashMap<String, WhenFull> = replies
                    .into_iter()
                    .map(|(master, reply)| (master, WhenFull::read(reply)))
                    .collect();
                for (master, now) in &masters {
                    if known.get(master) != Some(now) {
                        now.log(master);
                    }
                }
                // The masters of now only: one gone in a failover no longer counts.
                known = masters;
            }
            if let Some(value) = gauge_value(known.values()) {
                metrics.gauge(GAUGE).set(value);
            }
            tokio::time::sleep(PERIOD).await;
        }
    });
}

fn config_get() -> ::redis::Cmd {
    let mut cmd = ::redis::cmd("CONFIG");
    cmd.arg("GET").arg("maxmemory*");
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(pairs: &[(&str, &str)]) -> Value {
        Value::Array(
            pairs
                .iter()
                .flat_map(|(k, v)| [*k, *v])
                .map(|s| Value::BulkString(s.as_bytes().to_vec()))
                .collect(),
        )
    }

    #[test]
    fn a_masters_settings_say_what_it_does_once_full() {
        // Rows: the reply to CONFIG GET maxmemory*, what it says.
        let evicts = WhenFull::Evicts("volatile-lru".into());
        let rows = [
            (
                reply(&[("maxmemory", "1000"), ("maxmemory-policy", "volatile-lru")]),
                Some(evicts.clone()),
            ),
            (
                reply(&[("maxmemory", "1000"), ("maxmemory-policy", "noeviction")]),
                Some(WhenFull::Refuses),
            ),
            (
                reply(&[("maxmemory", "0"), ("maxmemory-policy", "allkeys-lru")]),
                Some(WhenFull::Unbounded),
            ),
            (reply(&[("maxmemory", "1000")]), None),
            (
                reply(&[("maxmemory", "x"), ("maxmemory-policy", "noeviction")]),
                None,
            ),
            (Value::Nil, None),
        ];
        for (reply, expected) in rows {
            let got = WhenFull::read(reply.clone());
            match expected {
                Some(expected) => assert_eq!(got, expected, "{reply:?}"),
                None => assert!(matches!(got, WhenFull::Unknown(_)), "{reply:?}: {got:?}"),
            }
        }
        // The gauge: one master that does not evict is enough for 0; unknowns say nothing.
        let unknown = WhenFull::Unknown("renamed".into());
        assert_eq!(gauge_value([&evicts, &unknown]), Some(1.0));
        assert_eq!(gauge_value([&evicts, &WhenFull::Refuses]), Some(0.0));
        assert_eq!(gauge_value([&WhenFull::Unbounded, &evicts]), Some(0.0));
        assert_eq!(gauge_value([&unknown]), None);
    }
}
