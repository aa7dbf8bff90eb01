//! The embedded backend: limit state in this process, exact for one instance.
//!
//! State is split over stripes, each a mutex around a map; a request locks its keys' stripes
//! in ascending order (no deadlock), checks every hit, then charges, never across an await.
//! Expired state is dropped lazily and by a sweep, and caps on live keys and on their bytes
//! (state included: a sliding window's log, a concurrency limit's permits) bound memory
//! whatever keys clients invent.
//!
//! A full stripe evicts rather than fails: a failure gets the failure policy's answer
//! (usually letting the request through), so one client inventing keys would switch limiting
//! off for everyone. Eviction samples a few entries and drops an expired one, else the least
//! recently used (recency is what a flood of keys used once cannot borrow), never a key of
//! the request being decided; an evicted key's count restarts.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use indexmap::IndexMap;
use metrics::Counter;
use tokio::time::MissedTickBehavior;

use super::Backend;
use crate::algorithm::{KeyState, Micros};
use crate::decision::{BackendError, Charging, Hit, Outcome};

const STRIPES: usize = 64;

/// Default cap on live keys.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// Default cap on the bytes live keys take.
pub const DEFAULT_MAX_BYTES: usize = 256 << 20;

/// What one entry costs besides its key's bytes: its slot in the map's entries (hash, key,
/// state) and in its index table (position, control byte), each up to twice over as both
/// grow by doubling, and the key's heap block.
const ENTRY_OVERHEAD: usize =
    2 * (std::mem::size_of::<(u64, String, Entry)>() + std::mem::size_of::<usize>() + 1) + 16;

/// How many entries an eviction samples. As in Redis's approximated LRU, 5 random entries
/// find one of the least recently used few percent, at a constant cost per eviction.
const EVICTION_SAMPLES: usize = 5;

/// The bytes an entry for `key` is accounted before its state's own (`Entry::bytes`).
fn entry_bytes(key: &str) -> usize {
    key.len() + ENTRY_OVERHEAD
}

#[derive(Clone)]
struct Entry {
    /// None until the first commit.
    state: Option<KeyState>,
    expires_at: Micros,
    /// When a request last checked or charged it: what eviction keeps.
    used_at: Micros,
    /// The bytes it is accounted as of its last commit: its key's and what its state holds
    /// on the heap (a sliding window's log, a concurrency limit's permits), which grows with
    /// admissions, so a cap on bytes must count it.
    bytes: usize,
}

impl Entry {
    /// An entry that holds nothing yet (the first commit gives it its algorithm's state).
    fn fresh(now: Micros) -> Entry {
        Entry {
            state: None,
            expires_at: 0,
            used_at: now,
            bytes: 0,
        }
    }
}

/// One stripe's entries, and the bytes they are accounted. An index map, so that eviction
/// can sample entries at random in constant time.
#[derive(Default)]
struct Stripe {
    entries: IndexMap<String, Entry>,
    bytes: usize,
}

impl Stripe {
    /// The entry for `key`, marked as used at `now`.
    fn touch(&mut self, key: &str, now: Micros) -> Option<&Entry> {
        let entry = self.entries.get_mut(key)?;
        entry.used_at = now;
        Some(entry)
    }

    /// Drop expired entries.
    fn sweep(&mut self, now: Micros) {
        let mut freed = 0;
        self.entries.retain(|_, e| {
            let live = e.expires_at > now;
            if !live {
                freed += e.bytes;
            }
            live
        });
        self.bytes -= freed;
    }

    /// Evict entries until `growth` fits in `max_keys` and `max_bytes`, sparing the keys
    /// `spared` holds. Returns how many were evicted.
    fn make_room(
        &mut self,
        growth: Growth,
        (max_keys, max_bytes): (usize, usize),
        spared: impl Fn(&str) -> bool,
        now: Micros,
    ) -> u64 {
        let (keys, bytes) = match growth {
            Growth::NewKey(bytes) => (1, bytes),
            Growth::Grown => (0, 0),
        };
        let mut evicted = 0;
        while self.entries.len() + keys > max_keys || self.bytes + bytes > max_bytes {
            // None: every entry left is spared, so the stripe holds only the request's keys.
            let Some(victim) = self.victim(&spared, now) else {
                break;
            };
            if let Some((_, entry)) = self.entries.swap_remove_index(victim) {
                self.bytes -= entry.bytes;
                evicted += 1;
            }
        }
        evicted
    }

    /// The position of the entry to evict: among a random sample of entries not spared, an
    /// expired one, else the least recently used. Should the sample hold only spared entries
    /// (the request's own keys fill the stripe), the first entry not spared.
    fn victim(&self, spared: impl Fn(&str) -> bool, now: Micros) -> Option<usize> {
        let len = self.entries.len();
        if len == 0 {
            return None;
        }
        // Expired entries rank first (false < true), then the least recently used.
        let rank = |i: usize| {
            let (key, e) = self.entries.get_index(i)?;
            (!spared(key)).then_some(((e.expires_at > now, e.used_at), i))
        };
        // Distinct entries spread over the whole map: a random start, then equal strides.
        let (start, stride) = (fastrand::usize(..len), (len / EVICTION_SAMPLES).max(1));
        let sampled = (0..EVICTION_SAMPLES.min(len))
            .filter_map(|j| rank((start + j * stride) % len))
            .min();
        sampled.or_else(|| (0..len).find_map(rank)).map(|(_, i)| i)
    }
}

fn check_any(entry: Option<&Entry>, hit: &Hit, now: Micros) -> Outcome {
    let live = entry.filter(|e| e.expires_at > now);
    KeyState::check(
        live.and_then(|e| e.state.as_ref()),
        &hit.limit,
        now,
        hit.cost(),
    )
}

/// What a stripe must make room for.
enum Growth {
    /// A key not yet held, of these bytes.
    NewKey(usize),
    /// A key held whose state grew, already counted in the stripe's bytes.
    Grown,
}

fn commit_any(entry: &mut Entry, hit: &Hit, now: Micros) {
    if entry.expires_at <= now {
        entry.state = None;
    }
    entry.expires_at = KeyState::commit(&mut entry.state, &hit.limit, now, hit.cost());
    entry.bytes = entry_bytes(&hit.key) + entry.state.as_ref().map_or(0, KeyState::heap_bytes);
}

fn lock(stripe: &Mutex<Stripe>) -> MutexGuard<'_, Stripe> {
    // Entries are updated in place by plain arithmetic that cannot panic halfway, so a
    // poisoned lock still guards consistent data.
    stripe.lock().unwrap_or_else(PoisonError::into_inner)
}

pub fn now_micros() -> Micros {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as Micros)
}

/// In-process limit state. Cheap to clone: clones share the state.
#[derive(Clone)]
pub struct MemoryBackend {
    stripes: Arc<[Mutex<Stripe>]>,
    hasher: RandomState,
    max_keys_per_stripe: usize,
    max_bytes_per_stripe: usize,
    evictions: Counter,
}

impl MemoryBackend {
    /// At most `max_keys` live keys taking at most `max_bytes` (as `entry_bytes` counts).
    pub fn new(max_keys: usize, max_bytes: usize) -> MemoryBackend {
        MemoryBackend {
            stripes: (0..STRIPES).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            max_keys_per_stripe: max_keys.div_ceil(STRIPES).max(1),
            max_bytes_per_stripe: max_bytes.div_ceil(STRIPES),
            evictions: Counter::noop(),
        }
    }

    /// Count the entries evicted to make room in `evictions`.
    pub fn counting_evictions(self, evictions: Counter) -> MemoryBackend {
        MemoryBackend { evictions, ..self }
    }

    /// The bytes live keys are accounted, up to `max_bytes`.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.stripes.iter().map(|s| lock(s).bytes).sum()
    }

    fn stripe_of(&self, key: &str) -> usize {
        self.hasher.hash_one(key) as usize % STRIPES
    }

    fn lock(&self, index: usize) -> MutexGuard<'_, Stripe> {
        lock(&self.stripes[index])
    }

    /// Sweep every stripe once per `period`, one stripe at a time, until the backend is
    /// dropped. Spread out, because a sweep is a pass over every entry, which calls served on
    /// the same CPU wait out: one stripe at a time keeps each pass short.
    pub fn spawn_sweeper(&self, period: Duration) {
        let stripes = Arc::downgrade(&self.stripes);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period / STRIPES as u32);
            tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            for next in (0..STRIPES).cycle() {
                tick.tick().await;
                let Some(stripes) = stripes.upgrade() else {
                    return;
                };
                lock(&stripes[next]).sweep(now_micros());
            }
        });
    }

    /// Evaluate synchronously: the whole work is a few map operations under locks. It never
    /// fails: a full stripe evicts.
    ///
    /// Hits are judged in order, each seeing the charges of the ones before it (a key met
    /// again in the request is judged on a scratch copy that holds them); then, if the
    /// request is to be charged, the same charges are made for real.
    pub fn evaluate_now(
        &self,
        hits: &[Hit],
        charging: Charging,
        now: Micros,
    ) -> Result<Vec<Outcome>, BackendError> {
        let writes = |h: &Hit, v: &Outcome| h.releases() || (v.admitted && h.units > 0);
        // One hit (one descriptor, one limit) is the common call: it needs one stripe and none
        // of the bookkeeping below and its allocations.
        if let [hit] = hits {
            let mut stripe = self.lock(self.stripe_of(&hit.key));
            let verdict = check_any(stripe.touch(&hit.key, now), hit, now);
            let verdicts = vec![verdict];
            if hit.releases() || (charging.charges(hits, &verdicts) && writes(hit, &verdict)) {
                self.charge(&mut stripe, hit, hits, now);
            }
            return Ok(verdicts);
        }
        let stripe_of: Vec<usize> = hits.iter().map(|h| self.stripe_of(&h.key)).collect();
        let mut order = stripe_of.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<MutexGuard<'_, Stripe>> = order.iter().map(|&i| self.lock(i)).collect();
        // Position of each hit's stripe among the held guards.
        let held: Vec<usize> = stripe_of
            .iter()
            .map(|s| order.partition_point(|i| i < s))
            .collect();

        let mut scratch: HashMap<&str, Entry> = HashMap::new();
        let mut verdicts: Vec<Outcome> = Vec::with_capacity(hits.len());
        for (i, (h, &g)) in hits.iter().zip(&held).enumerate() {
            let v = match scratch.get(h.key.as_str()) {
                Some(entry) => check_any(Some(entry), h, now),
                None => check_any(guards[g].touch(&h.key, now), h, now),
            };
            if writes(h, &v) && hits[i + 1..].iter().any(|later| later.key == h.key) {
                let stripe = &guards[g];
                let entry = scratch.entry(&h.key).or_insert_with(|| {
                    stripe
                        .entries
                        .get(&h.key)
                        .cloned()
                        .unwrap_or_else(|| Entry::fresh(now))
                });
                commit_any(entry, h, now);
            }
            verdicts.push(v);
        }
        let charge = charging.charges(hits, &verdicts);
        for ((h, v), &g) in hits.iter().zip(&verdicts).zip(&held) {
            if h.releases() || (charge && writes(h, v)) {
                self.charge(&mut guards[g], h, hits, now);
            }
        }
        Ok(verdicts)
    }

    /// Charge `hit`, making room for its key if it is new: the other keys of the request
    /// (`hits`) are spared, since they may be charged already or about to be.
    fn charge(&self, stripe: &mut Stripe, hit: &Hit, hits: &[Hit], now: Micros) {
        let caps = (self.max_keys_per_stripe, self.max_bytes_per_stripe);
        let spared = |key: &str| hits.iter().any(|h| h.key == key);
        let evicted = if let Some(entry) = stripe.entries.get_mut(&hit.key) {
            let before = entry.bytes;
            commit_any(entry, hit, now);
            let after = entry.bytes;
            stripe.bytes = stripe.bytes - before + after;
            if after > before {
                stripe.make_room(Growth::Grown, caps, spared, now)
            } else {
                0
            }
        } else {
            let mut entry = Entry::fresh(now);
            commit_any(&mut entry, hit, now);
            let bytes = entry.bytes;
            let evicted = stripe.make_room(Growth::NewKey(bytes), caps, spared, now);
            stripe.entries.insert(hit.key.clone(), entry);
            stripe.bytes += bytes;
            evicted
        };
        self.evictions.increment(evicted);
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
    use crate::decision::limit::{Algorithm, Limit, Unit};
    use crate::decision::{PermitOp, Role};
    use std::sync::atomic::{AtomicU64, Ordering};

    const T0: Micros = 1_700_000_000_000_000;

    fn hit(key: &str, limit: Limit, role: Role) -> Hit {
        Hit {
            key: key.into(),
            limit,
            units: 1,
            role,
            permit: None,
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
        for algorithm in Algorithm::ALL {
            let limit = Limit {
                algorithm,
                ..Limit::fixed(1, Unit::Second)
            };
            // Each call is a request of its own (for a concurrency limit, its own permit).
            let run = |now: Micros| {
                let h = Hit {
                    permit: (algorithm == Algorithm::Concurrency)
                        .then(|| (PermitOp::Acquire, format!("request-{now}"))),
                    ..hit(algorithm.name(), limit, Role::Enforce)
                };
                b.evaluate_now(&[h], Charging::Atomic, now)
            };
            assert!(run(T0).unwrap()[0].admitted, "{algorithm}");
            assert!(!run(T0 + 1).unwrap()[0].admitted, "{algorithm}");
            // One second after the admission its state is gone, not a microsecond before:
            // a sweep drops it then, and the key starts afresh.
            let second = T0 + 1_000_000;
            assert_eq!(sweep(&b.stripes, second - 1), 1, "{algorithm}: still live");
            assert_eq!(sweep(&b.stripes, second), 0, "{algorithm}: expired");
            let fresh = run(second).unwrap()[0];
            assert!(
                fresh.admitted && fresh.remaining == 0,
                "{algorithm}: {fresh:?}"
            );
            assert_eq!(sweep(&b.stripes, second + 1), 1, "{algorithm}: live again");
            sweep(&b.stripes, u64::MAX);
        }
    }

    /// Drop every expired entry. Returns how many live entries remain.
    fn sweep(stripes: &[Mutex<Stripe>], now: Micros) -> usize {
        stripes
            .iter()
            .map(|stripe| {
                let mut stripe = lock(stripe);
                stripe.sweep(now);
                stripe.entries.len()
            })
            .sum()
    }

    /// How many keys `b` holds.
    fn keys(b: &MemoryBackend) -> usize {
        b.stripes.iter().map(|s| lock(s).entries.len()).sum()
    }

    #[tokio::test(start_paused = true)]
    async fn the_sweeper_sweeps_one_stripe_a_step_and_every_stripe_once_a_period() {
        let b = MemoryBackend::new(10_000, DEFAULT_MAX_BYTES);
        // State that expired long ago (T0 is in 2023), in every stripe.
        let limit = Limit::fixed(1, Unit::Second);
        for n in 0..1_000 {
            let h = hit(&format!("key-{n}"), limit, Role::Enforce);
            b.evaluate_now(&[h], Charging::Atomic, T0).unwrap();
        }
        let per_stripe: Vec<usize> = b.stripes.iter().map(|s| lock(s).entries.len()).collect();
        assert!(per_stripe.iter().all(|&n| n > 0), "{per_stripe:?}");
        let period = Duration::from_millis(640);
        let step = period / STRIPES as u32;
        b.spawn_sweeper(period);
        // Half a step after each of the sweeper's steps (the first is at once): the stripes
        // swept so far are empty, the others untouched.
        tokio::time::sleep(step / 2).await;
        for swept in 1..=STRIPES {
            let left: usize = per_stripe[swept..].iter().sum();
            assert_eq!(keys(&b), left, "after {swept} steps");
            tokio::time::sleep(step).await;
        }
    }

    #[test]
    fn eviction_takes_an_expired_entry_then_the_least_recently_used_never_a_spared_one() {
        const NOW: Micros = 1_000;
        type Row<'a> = (
            &'a [(&'a str, Micros, Micros)],
            &'a [&'a str],
            Option<&'a str>,
        );
        // Entries as (key, expires_at, used_at), the keys spared, the key evicted.
        let rows: [Row<'_>; 6] = [
            (
                &[("old", 2_000, 1), ("gone", 900, 9), ("new", 2_000, 10)],
                &[],
                Some("gone"),
            ),
            (
                &[("old", 2_000, 1), ("mid", 2_000, 5), ("new", 2_000, 10)],
                &[],
                Some("old"),
            ),
            (
                &[("old", 2_000, 1), ("mid", 2_000, 5), ("new", 2_000, 10)],
                &["old"],
                Some("mid"),
            ),
            (
                &[("gone", 900, 1), ("new", 2_000, 10)],
                &["gone"],
                Some("new"),
            ),
            (&[("a", 2_000, 1), ("b", 2_000, 5)], &["a", "b"], None),
            (&[], &[], None),
        ];
        for (entries, spared, evicted) in rows {
            let mut stripe = Stripe::default();
            for &(key, expires_at, used_at) in entries {
                let entry = Entry {
                    state: None,
                    expires_at,
                    used_at,
                    bytes: 0,
                };
                stripe.entries.insert(key.into(), entry);
            }
            let victim = stripe.victim(|k| spared.contains(&k), NOW);
            let key = victim.map(|i| stripe.entries.get_index(i).unwrap().0.as_str());
            assert_eq!(key, evicted, "{entries:?} sparing {spared:?}");
        }
    }

    #[test]
    fn a_full_backend_evicts_and_a_key_in_use_keeps_its_count() {
        // Ten times the cap in year-long keys, each used once, with a key limited to 3 a
        // minute used between each two: every call is decided, the cap holds, and the key in
        // use is the one eviction keeps (admitted 3 times, then refused).
        let flood = Limit::fixed(10, Unit::Year);
        let victim = hit("victim", Limit::fixed(3, Unit::Minute), Role::Enforce);
        let capped_bytes = STRIPES * 10 * entry_bytes(&"k".repeat(4096));
        // (what is capped, max keys, max bytes, flood keys' length)
        for (cap, max_keys, max_bytes, len) in [
            ("keys", STRIPES * 10, DEFAULT_MAX_BYTES, 16),
            ("bytes", DEFAULT_MAX_KEYS, capped_bytes, 4096),
        ] {
            let evicted = Arc::new(AtomicU64::new(0));
            let b = MemoryBackend::new(max_keys, max_bytes)
                .counting_evictions(Counter::from_arc(evicted.clone()));
            let mut victim_admitted = Vec::new();
            let flooded = STRIPES * 10 * 10;
            for i in 0..flooded {
                let now = T0 + 2 * i as Micros;
                let h = hit(&format!("{i:0len$}"), flood, Role::Enforce);
                let answer = b.evaluate_now(&[h], Charging::Atomic, now).unwrap();
                assert!(
                    answer[0].admitted,
                    "{cap}: a new key is decided on its own limit"
                );
                let answer =
                    b.evaluate_now(std::slice::from_ref(&victim), Charging::Atomic, now + 1);
                victim_admitted.push(answer.unwrap()[0].admitted);
            }
            let admitted: Vec<usize> = (0..flooded).filter(|&i| victim_admitted[i]).collect();
            assert_eq!(admitted, [0, 1, 2], "{cap}: the key in use kept its count");
            let live = keys(&b);
            assert!(
                live <= max_keys && b.bytes() <= max_bytes,
                "{cap}: {live} keys"
            );
            assert!(
                b.bytes() > max_bytes / 2 || live > max_keys / 2,
                "{cap}: cap used"
            );
            let evicted = evicted.load(Ordering::Relaxed) as usize;
            assert_eq!(evicted, flooded + 1 - live, "{cap}: every eviction counted");
        }
    }

    #[test]
    fn a_request_keeps_its_own_keys_when_they_overflow_a_stripe() {
        // One key per stripe, and a request of 200 keys: none is evicted for another, so all
        // are charged, and the stripes are over their cap by that request's keys until their
        // next new key.
        let b = MemoryBackend::new(1, DEFAULT_MAX_BYTES);
        let limit = Limit::fixed(2, Unit::Day);
        let now = now_micros();
        let wide: Vec<Hit> = (0..200)
            .map(|i| hit(&format!("wide-{i}"), limit, Role::Enforce))
            .collect();
        let first = b.evaluate_now(&wide, Charging::Atomic, now).unwrap();
        assert!(first.iter().all(|o| o.admitted && o.remaining == 1));
        let again = b.evaluate_now(&wide, Charging::Atomic, now).unwrap();
        assert!(again.iter().all(|o| o.admitted && o.remaining == 0));
        assert_eq!(keys(&b), 200);
        for i in 0..2_000 {
            let h = hit(&format!("narrow-{i}"), limit, Role::Enforce);
            assert!(b.evaluate_now(&[h], Charging::Atomic, now).unwrap()[0].admitted);
        }
        assert_eq!(keys(&b), STRIPES, "each stripe back to its one key");
    }

    #[test]
    fn state_that_grows_with_admissions_counts_against_the_byte_cap() {
        // 64 KiB over 64 stripes: 1 KiB each. 200 short keys, each admitted 100 times: a
        // sliding window's log then holds 100 entries, a concurrency limit 100 permits of
        // 32-byte names, more than a stripe's share either way. Counted by their keys alone
        // all 200 would stay (some 40 KiB); counted with their state, each stripe keeps only
        // its latest key, whose own count is intact.
        let max = 64 << 10;
        let now = now_micros();
        let windowed = |algorithm| Limit {
            algorithm,
            ..Limit::fixed(10_000, Unit::Hour)
        };
        // (algorithm, the n-th hit on a key)
        type Nth = fn(&str, Limit, usize) -> Hit;
        let rows: [(Algorithm, Nth); 2] = [
            (Algorithm::SlidingWindow, |key, limit, _| {
                hit(key, limit, Role::Enforce)
            }),
            (Algorithm::Concurrency, |key, limit, n| Hit {
                permit: Some((PermitOp::Acquire, format!("{n:032}"))),
                ..hit(key, limit, Role::Enforce)
            }),
        ];
        for (algorithm, nth) in rows {
            let b = MemoryBackend::new(1_000_000, max);
            let limit = windowed(algorithm);
            for k in 0..200 {
                for n in 0..100 {
                    let h = nth(&format!("key-{k}"), limit, n);
                    assert!(b.evaluate_now(&[h], Charging::Atomic, now).unwrap()[0].admitted);
                }
            }
            assert!(keys(&b) <= STRIPES, "{algorithm:?}: {} keys kept", keys(&b));
            assert!(
                b.bytes() > max,
                "{algorithm:?}: each stripe holds a key over its share"
            );
            let last = nth("key-199", limit, 100);
            let outcome = b.evaluate_now(&[last], Charging::Nothing, now).unwrap()[0];
            // Its 100, and this one as if admitted.
            assert_eq!(
                outcome.remaining,
                10_000 - 101,
                "{algorithm:?}: the latest key's count"
            );
        }
    }

    #[test]
    fn the_byte_cap_holds_whatever_the_key_lengths() {
        // 64 KiB over 64 stripes: 1 KiB each. Keys of 100 bytes fit several to a stripe; a key
        // of 4 KiB is more than a stripe's share, so each stripe keeps only its latest one.
        let max = 64 << 10;
        let limit = Limit::fixed(100, Unit::Day);
        let now = now_micros();
        for (len, bound) in [(100, max), (4096, STRIPES * entry_bytes(&"k".repeat(4096)))] {
            let b = MemoryBackend::new(1_000_000, max);
            let key = |i: usize| format!("{i:0len$}");
            for i in 0..2_000 {
                let h = hit(&key(i), limit, Role::Enforce);
                assert!(b.evaluate_now(&[h], Charging::Atomic, now).unwrap()[0].admitted);
            }
            assert!(b.bytes() <= bound, "{len}: {} bytes", b.bytes());
            assert!(b.bytes() > bound / 2, "{len}: the cap is not far too tight");
            let known = (0..2_000)
                .find(|&i| {
                    lock(&b.stripes[b.stripe_of(&key(i))])
                        .entries
                        .contains_key(&key(i))
                })
                .unwrap();
            let again = hit(&key(known), limit, Role::Enforce);
            assert_eq!(
                b.evaluate_now(&[again], Charging::Atomic, now).unwrap()[0].remaining,
                98,
                "{len}: a known key is charged on its count"
            );
        }
    }
}
