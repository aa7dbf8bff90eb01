//! The embedded backend: limit state in this process, exact for one instance.
//!
//! State is split over shards, each a mutex around a map; a request locks the shards of its
//! keys in ascending order (so two requests can never deadlock), checks every hit, then
//! charges. Locks are held for microseconds and never across an await. Expired state is
//! equivalent to fresh state, so it is dropped lazily and by a periodic sweep, and caps on
//! live keys and on their bytes bound memory whatever keys clients invent: a count alone
//! would let long keys (a descriptor is up to a few KiB) cost a hundred times more.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{Backend, BackendError, Charging, Hit, Outcome, request_refused};
use crate::algorithm::concurrency::{self, Concurrency};
use crate::algorithm::fixed_window::{self, FixedWindow};
use crate::algorithm::sliding_window::{self, SlidingWindow};
use crate::algorithm::token_bucket::{self, TokenBucket};
use crate::algorithm::{Algorithm, Cost, Micros, Verdict};
use crate::limit::{Algorithm as Kind, Limit};

const SHARDS: usize = 64;

/// Default cap on live keys.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// Default cap on the bytes live keys take.
pub const DEFAULT_MAX_BYTES: usize = 256 << 20;

/// What one entry costs besides its key's bytes: the map's slot (key, state and control
/// byte, at its load factor) and the key's heap block.
const ENTRY_OVERHEAD: usize = 2 * std::mem::size_of::<(String, Entry)>() + 16;

/// The bytes an entry for `key` is accounted.
fn entry_bytes(key: &str) -> usize {
    key.len() + ENTRY_OVERHEAD
}

#[derive(Clone)]
enum KeyState {
    Fixed(fixed_window::State),
    Sliding(sliding_window::State),
    Bucket(token_bucket::State),
    Leases(concurrency::State),
}

#[derive(Clone)]
struct Entry {
    state: KeyState,
    expires_at: Micros,
}

impl Entry {
    /// An entry that holds nothing yet (the first commit gives it its algorithm's state).
    fn fresh() -> Entry {
        Entry {
            state: KeyState::Fixed(fixed_window::State::default()),
            expires_at: 0,
        }
    }
}

/// Ties an algorithm to its variant of `KeyState`.
trait Stored: Algorithm {
    fn get(state: &KeyState) -> Option<&Self::State>;
    fn get_mut(state: &mut KeyState) -> Option<&mut Self::State>;
    fn wrap(state: Self::State) -> KeyState;
}

macro_rules! stored {
    ($algorithm:ty, $variant:ident) => {
        impl Stored for $algorithm {
            fn get(state: &KeyState) -> Option<&Self::State> {
                match state {
                    KeyState::$variant(s) => Some(s),
                    _ => None,
                }
            }
            fn get_mut(state: &mut KeyState) -> Option<&mut Self::State> {
                match state {
                    KeyState::$variant(s) => Some(s),
                    _ => None,
                }
            }
            fn wrap(state: Self::State) -> KeyState {
                KeyState::$variant(state)
            }
        }
    };
}
stored!(FixedWindow, Fixed);
stored!(SlidingWindow, Sliding);
stored!(TokenBucket, Bucket);
stored!(Concurrency, Leases);

/// One shard's entries, and the bytes they are accounted.
#[derive(Default)]
struct Shard {
    entries: HashMap<String, Entry>,
    bytes: usize,
}

impl Shard {
    fn get(&self, key: &str) -> Option<&Entry> {
        self.entries.get(key)
    }

    /// The entry for `key`, created fresh (and accounted) if absent.
    fn entry(&mut self, key: &str) -> &mut Entry {
        if !self.entries.contains_key(key) {
            self.bytes += entry_bytes(key);
            self.entries.insert(key.to_owned(), Entry::fresh());
        }
        self.entries.get_mut(key).expect("inserted above")
    }

    /// Drop expired entries.
    fn sweep(&mut self, now: Micros) {
        let mut freed = 0;
        self.entries.retain(|key, e| {
            let live = e.expires_at > now;
            if !live {
                freed += entry_bytes(key);
            }
            live
        });
        self.bytes -= freed;
    }
}

fn check<A: Stored>(entry: Option<&Entry>, limit: &Limit, now: Micros, cost: Cost<'_>) -> Verdict {
    let live = entry
        .filter(|e| e.expires_at > now)
        .and_then(|e| A::get(&e.state));
    match live {
        Some(state) => A::check(state, limit, now, cost),
        None => A::check(&A::State::default(), limit, now, cost),
    }
}

fn commit<A: Stored>(entry: &mut Entry, limit: &Limit, now: Micros, cost: Cost<'_>) {
    if entry.expires_at <= now || A::get(&entry.state).is_none() {
        entry.state = A::wrap(A::State::default());
    }
    if let Some(state) = A::get_mut(&mut entry.state) {
        A::commit(state, limit, now, cost);
        entry.expires_at = A::expires_at(state, limit);
    }
}

fn check_any(entry: Option<&Entry>, hit: &Hit, now: Micros) -> Verdict {
    let (limit, cost) = (&hit.limit, hit.cost());
    match limit.algorithm {
        Kind::FixedWindow => check::<FixedWindow>(entry, limit, now, cost),
        Kind::SlidingWindow => check::<SlidingWindow>(entry, limit, now, cost),
        Kind::TokenBucket => check::<TokenBucket>(entry, limit, now, cost),
        Kind::Concurrency => check::<Concurrency>(entry, limit, now, cost),
    }
}

fn commit_any(entry: &mut Entry, hit: &Hit, now: Micros) {
    let (limit, cost) = (&hit.limit, hit.cost());
    match limit.algorithm {
        Kind::FixedWindow => commit::<FixedWindow>(entry, limit, now, cost),
        Kind::SlidingWindow => commit::<SlidingWindow>(entry, limit, now, cost),
        Kind::TokenBucket => commit::<TokenBucket>(entry, limit, now, cost),
        Kind::Concurrency => commit::<Concurrency>(entry, limit, now, cost),
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // Entries are updated in place by plain arithmetic that cannot panic halfway, so a
    // poisoned lock still guards consistent data.
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

fn sweep(shards: &[Mutex<Shard>], now: Micros) -> usize {
    shards
        .iter()
        .map(|shard| {
            let mut shard = lock(shard);
            shard.sweep(now);
            shard.entries.len()
        })
        .sum()
}

fn now_micros() -> Micros {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as Micros)
}

/// In-process limit state. Cheap to clone: clones share the state.
#[derive(Clone)]
pub struct MemoryBackend {
    shards: Arc<[Mutex<Shard>]>,
    hasher: RandomState,
    max_keys_per_shard: usize,
    max_bytes_per_shard: usize,
}

impl MemoryBackend {
    /// At most `max_keys` live keys taking at most `max_bytes` (as `entry_bytes` counts).
    pub fn new(max_keys: usize, max_bytes: usize) -> MemoryBackend {
        MemoryBackend {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            max_keys_per_shard: max_keys.div_ceil(SHARDS).max(1),
            max_bytes_per_shard: max_bytes.div_ceil(SHARDS),
        }
    }

    /// The bytes live keys are accounted, up to `max_bytes`.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.shards.iter().map(|s| lock(s).bytes).sum()
    }

    fn shard_of(&self, key: &str) -> usize {
        self.hasher.hash_one(key) as usize % SHARDS
    }

    fn lock(&self, index: usize) -> MutexGuard<'_, Shard> {
        lock(&self.shards[index])
    }

    /// Drop every expired entry. Returns how many live entries remain.
    pub fn sweep(&self) -> usize {
        sweep(&self.shards, now_micros())
    }

    /// Sweep every `period` until the backend is dropped.
    pub fn spawn_sweeper(&self, period: Duration) {
        let shards = Arc::downgrade(&self.shards);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                let Some(shards) = shards.upgrade() else {
                    return;
                };
                sweep(&shards, now_micros());
            }
        });
    }

    /// Evaluate synchronously: the whole work is a few map operations under locks.
    ///
    /// Hits are judged in order, each seeing the charges of the ones before it (a key met
    /// again in the request is judged on a scratch copy that holds them); then, if the
    /// request is to be charged, the same charges are made for real. Room for the keys a
    /// charge would create is made before anything is charged, so a full backend refuses the
    /// whole request and never leaves part of it charged.
    pub fn evaluate_now(
        &self,
        hits: &[Hit],
        charging: Charging,
        now: Micros,
    ) -> Result<Vec<Outcome>, BackendError> {
        let shard_of: Vec<usize> = hits.iter().map(|h| self.shard_of(&h.key)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<MutexGuard<'_, Shard>> = order.iter().map(|&i| self.lock(i)).collect();
        // Position of each hit's shard among the held guards.
        let held: Vec<usize> = shard_of
            .iter()
            .map(|s| order.partition_point(|i| i < s))
            .collect();

        let writes = |h: &Hit, v: &Verdict| h.releases() || (v.admitted && h.hits > 0);
        let mut scratch: HashMap<&str, Entry> = HashMap::new();
        let mut verdicts: Vec<Verdict> = Vec::with_capacity(hits.len());
        for (i, (h, &g)) in hits.iter().zip(&held).enumerate() {
            let stored = scratch
                .get(h.key.as_str())
                .or_else(|| guards[g].get(&h.key));
            let v = check_any(stored, h, now);
            if writes(h, &v) && hits[i + 1..].iter().any(|later| later.key == h.key) {
                let shard = &guards[g];
                let entry = scratch
                    .entry(&h.key)
                    .or_insert_with(|| shard.get(&h.key).cloned().unwrap_or_else(Entry::fresh));
                commit_any(entry, h, now);
            }
            verdicts.push(v);
        }
        let charge = match charging {
            Charging::PerDescriptor => true,
            Charging::Nothing => false,
            Charging::Atomic => !request_refused(
                hits.iter()
                    .zip(&verdicts)
                    .map(|(h, v)| (h.role, v.admitted)),
            ),
        };
        let writing: Vec<bool> = hits
            .iter()
            .zip(&verdicts)
            .map(|(h, v)| h.releases() || (charge && writes(h, v)))
            .collect();
        self.make_room(&mut guards, hits, &held, &writing, now)?;
        for ((h, &g), _) in hits.iter().zip(&held).zip(&writing).filter(|(_, w)| **w) {
            commit_any(guards[g].entry(&h.key), h, now);
        }
        Ok(verdicts
            .into_iter()
            .map(|v| Outcome {
                admitted: v.admitted,
                remaining: v.remaining,
                reset_after: Duration::from_micros(v.reset_after),
            })
            .collect())
    }

    /// Make sure every shard can take the new keys the `writing` hits would create (in count
    /// and bytes), dropping expired entries if needed; `Full` when one cannot.
    fn make_room(
        &self,
        guards: &mut [MutexGuard<'_, Shard>],
        hits: &[Hit],
        held: &[usize],
        writing: &[bool],
        now: Micros,
    ) -> Result<(), BackendError> {
        let mut new_keys: Vec<(usize, &str)> = hits
            .iter()
            .zip(held)
            .zip(writing)
            .filter(|((h, g), w)| {
                **w && guards[**g].get(&h.key).is_none_or(|e| e.expires_at <= now)
            })
            .map(|((h, g), _)| (*g, h.key.as_str()))
            .collect();
        new_keys.sort_unstable();
        new_keys.dedup();
        for (g, shard) in guards.iter_mut().enumerate() {
            let (adding, bytes) = new_keys
                .iter()
                .filter(|(of, _)| *of == g)
                .fold((0, 0), |(n, b), (_, key)| (n + 1, b + entry_bytes(key)));
            let fits = |shard: &Shard| {
                shard.entries.len() + adding <= self.max_keys_per_shard
                    && shard.bytes + bytes <= self.max_bytes_per_shard
            };
            if adding == 0 || fits(shard) {
                continue;
            }
            shard.sweep(now);
            if !fits(shard) {
                return Err(BackendError::Full(format!(
                    "more than {} live keys or {} bytes of them",
                    self.max_keys_per_shard * SHARDS,
                    self.max_bytes_per_shard * SHARDS
                )));
            }
        }
        Ok(())
    }
}

impl MemoryBackend {
    /// `Backend::evaluate` without the future: the work never waits.
    pub fn evaluate_sync(
        &self,
        hits: &[Hit],
        charging: Charging,
    ) -> Result<Vec<Outcome>, BackendError> {
        self.evaluate_now(hits, charging, now_micros())
    }
}

impl Backend for MemoryBackend {
    async fn evaluate(
        &self,
        hits: &[Hit],
        charging: Charging,
    ) -> Result<Vec<Outcome>, BackendError> {
        self.evaluate_sync(hits, charging)
    }

    async fn ready(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::LeaseOp;
    use crate::backend::Role;
    use crate::limit::Unit;

    const T0: Micros = 1_700_000_000_000_000;

    fn hit(key: &str, limit: Limit, role: Role) -> Hit {
        Hit {
            key: key.into(),
            limit,
            hits: 1,
            role,
            lease: None,
        }
    }

    fn admitted(outcomes: &[Outcome]) -> Vec<bool> {
        outcomes.iter().map(|o| o.admitted).collect()
    }

    #[test]
    fn a_refused_request_charges_none_of_its_hits() {
        let b = MemoryBackend::new(100, DEFAULT_MAX_BYTES);
        let wide = hit("wide", Limit::fixed(10, Unit::Minute), Role::Enforce);
        let narrow = hit("narrow", Limit::fixed(1, Unit::Minute), Role::Enforce);
        let both = [wide.clone(), narrow];
        let first = b.evaluate_now(&both, Charging::Atomic, T0).unwrap();
        assert_eq!(admitted(&first), [true, true]);
        assert_eq!(first[0].remaining, 9);
        let second = b.evaluate_now(&both, Charging::Atomic, T0).unwrap();
        assert_eq!(admitted(&second), [true, false]);
        // "wide" was not charged by the refused request.
        let alone = b.evaluate_now(&[wide], Charging::Atomic, T0).unwrap();
        assert_eq!(alone[0].remaining, 8);
    }

    #[test]
    fn per_descriptor_charging_charges_admitted_hits_of_refused_requests() {
        let b = MemoryBackend::new(100, DEFAULT_MAX_BYTES);
        let wide = hit("wide", Limit::fixed(10, Unit::Minute), Role::Enforce);
        let narrow = hit("narrow", Limit::fixed(0, Unit::Minute), Role::Enforce);
        b.evaluate_now(&[wide.clone(), narrow], Charging::PerDescriptor, T0)
            .unwrap();
        let alone = b.evaluate_now(&[wide], Charging::Atomic, T0).unwrap();
        assert_eq!(alone[0].remaining, 8);
    }

    #[test]
    fn shadow_hits_never_refuse_the_request() {
        let b = MemoryBackend::new(100, DEFAULT_MAX_BYTES);
        let shadow = hit("s", Limit::fixed(0, Unit::Second), Role::Shadow);
        let real = hit("r", Limit::fixed(5, Unit::Second), Role::Enforce);
        b.evaluate_now(&[shadow, real.clone()], Charging::Atomic, T0)
            .unwrap();
        let alone = b.evaluate_now(&[real], Charging::Atomic, T0).unwrap();
        assert_eq!(alone[0].remaining, 3, "charged once before");
    }

    #[test]
    fn every_algorithm_runs_on_it_and_state_expires() {
        let b = MemoryBackend::new(100, DEFAULT_MAX_BYTES);
        for algorithm in Kind::ALL {
            let limit = Limit {
                algorithm,
                ..Limit::fixed(1, Unit::Second)
            };
            // Each call is a request of its own (for a concurrency limit, its own lease).
            let run = |now: Micros| {
                let h = Hit {
                    lease: (algorithm == Kind::Concurrency)
                        .then(|| (LeaseOp::Acquire, format!("request-{now}"))),
                    ..hit(algorithm.name(), limit, Role::Enforce)
                };
                b.evaluate_now(&[h], Charging::Atomic, now)
            };
            assert!(run(T0).unwrap()[0].admitted, "{algorithm}");
            assert!(!run(T0 + 1).unwrap()[0].admitted, "{algorithm}");
        }
        assert_eq!(b.sweep(), 0, "all state was of 2023 and has expired");
    }

    #[test]
    fn the_byte_cap_holds_whatever_the_key_lengths() {
        // 64 KiB over 64 shards: 1 KiB each. Keys of 100 bytes fit several to a shard,
        // keys of 4 KiB none; known keys are still charged when the cap is reached.
        let max = 64 << 10;
        let limit = Limit::fixed(100, Unit::Day);
        let now = now_micros();
        for (len, fits) in [(100, true), (4096, false)] {
            let b = MemoryBackend::new(1_000_000, max);
            let key = |i: usize| format!("{i:0len$}");
            let admitted = (0..2_000)
                .filter(|&i| {
                    let h = hit(&key(i), limit, Role::Enforce);
                    b.evaluate_now(&[h], Charging::Atomic, now).is_ok()
                })
                .count();
            assert!(b.bytes() <= max, "{len}: {} bytes", b.bytes());
            assert_eq!(admitted > 0, fits, "{len}: {admitted} admitted");
            if fits {
                assert!(b.bytes() > max / 2, "{len}: the cap is not far too tight");
                let known = (0..2_000)
                    .find(|&i| lock(&b.shards[b.shard_of(&key(i))]).get(&key(i)).is_some())
                    .unwrap();
                let again = hit(&key(known), limit, Role::Enforce);
                assert_eq!(
                    b.evaluate_now(&[again], Charging::Atomic, now).unwrap()[0].remaining,
                    98
                );
            }
        }
    }

    #[test]
    fn a_full_backend_refuses_the_whole_request_and_charges_none_of_it() {
        let b = MemoryBackend::new(1, DEFAULT_MAX_BYTES); // one key per shard
        let limit = Limit::fixed(5, Unit::Hour);
        let shard = b.shard_of("a");
        let same = (0..)
            .map(|i| format!("b{i}"))
            .find(|k| b.shard_of(k) == shard)
            .unwrap();
        let other = (0..)
            .map(|i| format!("c{i}"))
            .find(|k| b.shard_of(k) != shard)
            .unwrap();
        let request = [&other, "a", &same].map(|k| hit(k, limit, Role::Enforce));
        // Two new keys for a shard with room for one.
        let full = b.evaluate_now(&request, Charging::PerDescriptor, T0);
        assert!(matches!(full, Err(BackendError::Full(_))), "{full:?}");
        for key in [other.as_str(), "a"] {
            let alone = b.evaluate_now(&[hit(key, limit, Role::Enforce)], Charging::Atomic, T0);
            assert_eq!(
                alone.unwrap()[0].remaining,
                4,
                "{key} was not charged before"
            );
        }
    }

    #[test]
    fn the_key_cap_refuses_new_keys_but_not_known_ones() {
        let b = MemoryBackend::new(1, DEFAULT_MAX_BYTES);
        let limit = Limit::fixed(100, Unit::Day);
        let now = now_micros();
        let mut full = 0;
        for i in 0..200 {
            let h = hit(&format!("k{i}"), limit, Role::Enforce);
            if b.evaluate_now(&[h], Charging::Atomic, now).is_err() {
                full += 1;
            }
        }
        assert!(
            full > 0,
            "a cap of 64 keys (one per shard) must refuse some of 200"
        );
        assert!(b.sweep() <= SHARDS);
    }
}
