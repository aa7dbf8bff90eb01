//! Where the shares live: in this process (memory backend, or the `local` failure policy),
//! or in Redis, so that every turnstile instance sees every Envoy's demand and reservation
//! and assigns consistently. One hash per bucket, keyed under the limit's own Cluster hash
//! tag, one field per holder (one bucket of one Envoy stream); entries expire `ttl` after
//! their holder's last report.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use super::share::{self, HYSTERESIS, IDLE_WEIGHT, Others};
use crate::backend::redis::{Lua, RedisBackend};
use crate::decision::BackendError;
use crate::decision::bounded::Capacity;

static SHARE_SCRIPT: LazyLock<Lua> =
    LazyLock::new(|| Lua::new(include_str!("../../lua/rlqs_share.lua")));

/// Suffix of a bucket's hash after its limit's key.
const SUFFIX: &str = ":rlqs";

/// One holder's report.
#[derive(Debug, Clone, Copy)]
pub struct Demand<'a> {
    /// The limit's state key (`crate::decision::key::limit_key`).
    pub key: &'a str,
    /// Who holds the share: one of an Envoy's buckets.
    pub holder: u64,
    /// Requests per window of the limit.
    pub demand: f64,
    /// The limit, requests per window.
    pub limit: u64,
}

pub enum ShareStore {
    Memory(MemoryShares),
    /// Filled once the backend's Redis is connected.
    Redis(Arc<OnceLock<RedisBackend>>),
}

impl ShareStore {
    /// Record the demand and reserve (and return) the holder's share.
    pub async fn share(&self, demand: Demand<'_>, ttl: Duration) -> Result<u64, BackendError> {
        match self {
            ShareStore::Memory(memory) => memory.share_now(demand, ttl),
            ShareStore::Redis(cell) => {
                let redis = connected(cell)?;
                let args = [
                    demand.holder.to_string(),
                    format!("{:.3}", demand.demand),
                    demand.limit.to_string(),
                    (demand.limit as f64 * IDLE_WEIGHT).to_string(),
                    HYSTERESIS.to_string(),
                    ttl.as_millis().to_string(),
                ];
                let reply = redis.eval(&SHARE_SCRIPT, demand.key, SUFFIX, &args).await?;
                u64::try_from(reply).map_err(|_| {
                    BackendError::Unavailable(format!("the share script replied {reply}"))
                })
            }
        }
    }

    /// The holder's stream is gone: free its reservation now rather than at expiry.
    pub async fn leave(&self, key: &str, holder: u64) -> Result<(), BackendError> {
        match self {
            ShareStore::Memory(memory) => {
                memory.leave(key, holder);
                Ok(())
            }
            ShareStore::Redis(cell) => {
                // A negative demand removes the holder's field; the rest is unused.
                let mut args = vec![holder.to_string(), "-1".to_owned()];
                args.resize(6, "0".to_owned());
                connected(cell)?
                    .eval(&SHARE_SCRIPT, key, SUFFIX, &args)
                    .await
                    .map(drop)
            }
        }
    }
}

fn connected(cell: &OnceLock<RedisBackend>) -> Result<&RedisBackend, BackendError> {
    cell.get()
        .ok_or_else(|| BackendError::Unavailable("not connected yet".into()))
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    demand: f64,
    share: u64,
    expires: Instant,
}

/// Shares in this process, bounded: at most `max_buckets` buckets, each expiring with its
/// last holder's entry.
pub struct MemoryShares {
    buckets: Mutex<Buckets>,
    max_buckets: usize,
}

#[derive(Default)]
struct Buckets {
    by_key: HashMap<String, HashMap<u64, Entry>>,
    capacity: Capacity,
}

/// When a bucket's last entry expires (`None`: it has none).
fn expiry(entries: &HashMap<u64, Entry>) -> Option<Instant> {
    entries.values().map(|e| e.expires).max()
}

impl MemoryShares {
    pub fn new(max_buckets: usize) -> MemoryShares {
        MemoryShares {
            buckets: Mutex::default(),
            max_buckets,
        }
    }

    /// Record the demand and reserve (and return) the holder's share, now.
    pub fn share_now(&self, d: Demand<'_>, ttl: Duration) -> Result<u64, BackendError> {
        self.share(d, ttl, Instant::now())
    }

    fn share(&self, d: Demand<'_>, ttl: Duration, now: Instant) -> Result<u64, BackendError> {
        let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        let Buckets { by_key, capacity } = &mut *buckets;
        if !by_key.contains_key(d.key) && !capacity.make_room(by_key, self.max_buckets, now, expiry)
        {
            return Err(BackendError::Full(format!(
                "{} RLQS buckets tracked",
                by_key.len()
            )));
        }
        // The bucket lasts at least as long as this holder's entry, which may come first.
        capacity.kept(Some(now + ttl));
        let entries = by_key.entry(d.key.to_owned()).or_default();
        entries.retain(|_, e| e.expires > now);
        let idle = d.limit as f64 * IDLE_WEIGHT;
        let others = entries
            .iter()
            .filter(|(holder, _)| **holder != d.holder)
            .fold(Others::default(), |sum, (_, e)| Others {
                weight: sum.weight + e.demand + idle,
                reserved: sum.reserved + e.share,
            });
        let held = entries.get(&d.holder).map(|e| e.share);
        let share = share::assign(d.limit, d.demand, others, held);
        entries.insert(
            d.holder,
            Entry {
                demand: d.demand,
                share,
                expires: now + ttl,
            },
        );
        Ok(share)
    }

    pub fn leave(&self, key: &str, holder: u64) {
        let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        let Buckets { by_key, capacity } = &mut *buckets;
        if let Some(entries) = by_key.get_mut(key) {
            entries.remove(&holder);
            // The bucket's expiry may now come sooner.
            capacity.clear();
            if entries.is_empty() {
                by_key.remove(key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_add_up_to_the_limit_expire_and_are_freed_on_leave() {
        let shares = MemoryShares::new(10);
        let ttl = Duration::from_secs(15);
        let t0 = Instant::now();
        let report = |holder, demand| Demand {
            key: "d|name=api|fixed_window:1",
            holder,
            demand,
            limit: 100,
        };
        // A alone takes everything; B arrives with 9x the demand but only gets what is free.
        assert_eq!(shares.share(report(1, 10.0), ttl, t0), Ok(100));
        assert_eq!(shares.share(report(2, 90.0), ttl, t0), Ok(0));
        // A reports again and shrinks; B then takes its proportional share.
        let a = shares.share(report(1, 10.0), ttl, t0).unwrap();
        let b = shares.share(report(2, 90.0), ttl, t0).unwrap();
        assert_eq!((a, b), (13, 86));
        assert!(a + b <= 100);
        // A's entry expires: B gets it all at its next report.
        let later = t0 + ttl + Duration::from_millis(1);
        assert_eq!(shares.share(report(2, 90.0), ttl, later), Ok(100));
        // B leaves: A, back, finds all of it free.
        shares.leave(report(2, 0.0).key, 2);
        assert_eq!(shares.share(report(1, 10.0), ttl, later), Ok(100));
    }

    #[test]
    fn the_number_of_buckets_is_bounded() {
        let shares = MemoryShares::new(2);
        let ttl = Duration::from_secs(1);
        let now = Instant::now();
        let report = |key| Demand {
            key,
            holder: 1,
            demand: 1.0,
            limit: 10,
        };
        assert!(shares.share(report("a"), ttl, now).is_ok());
        assert!(shares.share(report("b"), ttl, now).is_ok());
        assert!(matches!(
            shares.share(report("c"), ttl, now),
            Err(BackendError::Full(_))
        ));
        // Expired buckets make capacity.
        let later = now + ttl + Duration::from_millis(1);
        assert!(shares.share(report("c"), ttl, later).is_ok());
    }
}
