//! What an instance admitted alone while its shared backend failed (the `local` failure
//! policy), owed to that backend: charged there once it answers again, before the instance
//! decides from it again, so that an outage's local admissions count in the same windows as
//! everyone else's, and the backend refuses what the fleet admitted meanwhile.
//!
//! Owed units are summed per key, with when they stop mattering: a fixed window's end, or for
//! a sliding window one window after the last admission. A charge past that can change no
//! decision and is dropped. The ledger is bounded: when it is full of charges that still
//! matter, a request that needs a new entry is refused rather than admitted uncounted, so an
//! outage cannot turn into admissions nobody will ever charge.
//!
//! The ledger also keeps which keys were admitted alone: for a moment after this instance has
//! charged the backend ([`HOLD`]), those keys stay within its local share too, because the
//! other instances may not have charged what they admitted alone yet (see `fallback`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::algorithm::{Micros, window_micros};
use crate::decision::limit::{Algorithm, Limit};
use crate::decision::{BackendError, Charging, Hit, Outcome, Role};

/// How long keys admitted alone stay within the local share once this instance has charged
/// what it owed: the other instances learn of a recovery (a failover's announcement, Redis
/// answering again) at about the same time, and charge theirs at their next call.
pub const HOLD: Micros = 250_000;

/// Whether a hit's charges can be carried to the backend: the window algorithms', whose
/// charges add up whatever the limit. A token bucket's state depends on its rate, and a
/// concurrency limit's leases live in the process that took them.
pub fn carried(hit: &Hit) -> bool {
    matches!(
        hit.limit.algorithm,
        Algorithm::FixedWindow | Algorithm::SlidingWindow
    )
}

/// When a charge made at `now` on `limit` stops mattering.
pub fn matters_until(limit: &Limit, now: Micros) -> Micros {
    let window = window_micros(limit).max(1);
    match limit.algorithm {
        Algorithm::FixedWindow => now - now % window + window,
        _ => now + window,
    }
}

/// Units owed on one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owed {
    pub key: String,
    pub limit: Limit,
    pub units: u64,
    /// When the charge stops mattering.
    pub until: Micros,
}

impl Owed {
    /// The hit that charges it: admitted whatever the backend's count (the admissions were
    /// made already), in the window it is charged at. No quota lease, so no layer answers it
    /// from units taken earlier, and a limit no cached refusal holds for.
    pub fn hit(&self) -> Hit {
        Hit {
            key: self.key.clone(),
            limit: Limit {
                requests_per_unit: u32::MAX,
                burst: u32::MAX,
                quota_lease: 0,
                ..self.limit
            },
            units: self.units,
            role: Role::Enforce,
            permit: None,
        }
    }
}

pub struct Ledger {
    owed: Mutex<Entries>,
    max: usize,
    /// Whether anything is owed: read on every request, without the lock.
    owes: AtomicBool,
    /// Whether any key was admitted alone in a window that may still run: read on every
    /// request, without the lock.
    any_alone: AtomicBool,
    /// When this instance last finished charging what it owed; 0 while it still owes.
    settled_at: AtomicU64,
}

#[derive(Default)]
struct Entries {
    by_key: HashMap<String, (Limit, u64, Micros)>,
    /// Every key admitted alone, until its charge stops mattering (owed or already charged):
    /// what bounds the ledger.
    alone: HashMap<String, Micros>,
    /// In a ledger found full, the earliest time an entry stops mattering: no room before.
    full_until: Option<Micros>,
    /// Charges taken to be charged and not yet known charged: still owed, until then.
    taken: usize,
}

impl Entries {
    fn owes(&self) -> bool {
        !self.by_key.is_empty() || self.taken > 0
    }
}

impl Entries {
    /// Owe `units` on `key` at `now`. A charge of another limit on the key (the rules
    /// changed), or one that no longer matters, is replaced.
    fn add(&mut self, key: &str, limit: Limit, units: u64, now: Micros) {
        let until = matters_until(&limit, now);
        match self.alone.get_mut(key) {
            Some(alone) => *alone = (*alone).max(until),
            None => {
                self.alone.insert(key.to_owned(), until);
            }
        }
        match self.by_key.get_mut(key) {
            Some(entry) if entry.0 == limit && entry.2 > now => {
                entry.1 += units;
                entry.2 = entry.2.max(until);
            }
            Some(entry) => *entry = (limit, units, until),
            None => {
                self.by_key.insert(key.to_owned(), (limit, units, until));
            }
        }
    }

    /// Whether `new` more keys fit, after dropping what no longer matters if they do not.
    fn room(&mut self, new: usize, max: usize, now: Micros) -> bool {
        if self.alone.len() + new <= max {
            return true;
        }
        if self.full_until.is_some_and(|until| now < until) {
            return false;
        }
        self.alone.retain(|_, until| *until > now);
        self.by_key.retain(|_, entry| entry.2 > now);
        let fits = self.alone.len() + new <= max;
        self.full_until = if fits {
            None
        } else {
            self.alone.values().copied().min()
        };
        fits
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What [`Ledger::take`] took.
#[derive(Debug, Default)]
pub struct Taken {
    pub owed: Vec<Owed>,
    /// Units dropped because they no longer matter.
    pub dropped: u64,
}

impl Ledger {
    /// A ledger of at most `max` keys.
    pub fn new(max: usize) -> Ledger {
        Ledger {
            owed: Mutex::default(),
            max,
            owes: AtomicBool::new(false),
            any_alone: AtomicBool::new(false),
            settled_at: AtomicU64::new(0),
        }
    }

    pub fn owes(&self) -> bool {
        self.owes.load(Ordering::Acquire)
    }

    /// Decide a request on `hits` alone (`decide`) and owe what it charged; `None`, deciding
    /// nothing, when the ledger has no room for its charges. Other requests wait meanwhile, so
    /// none takes the room this one was counted in.
    pub fn admit(
        &self,
        hits: &[Hit],
        charging: Charging,
        now: Micros,
        decide: impl FnOnce() -> Result<Vec<Outcome>, BackendError>,
    ) -> Option<Result<Vec<Outcome>, BackendError>> {
        let mut entries = lock(&self.owed);
        let new = hits
            .iter()
            .filter(|h| carried(h) && h.units > 0 && !entries.alone.contains_key(&h.key))
            .count();
        if !entries.room(new, self.max, now) {
            return None;
        }
        let decided = decide();
        if let Ok(verdicts) = &decided
            && charging.charges(hits, verdicts)
        {
            for (hit, verdict) in hits.iter().zip(verdicts) {
                if verdict.admitted && hit.units > 0 && carried(hit) {
                    entries.add(&hit.key, hit.limit, hit.units, now);
                }
            }
            self.owes.store(entries.owes(), Ordering::Release);
            self.any_alone
                .store(!entries.alone.is_empty(), Ordering::Release);
            self.settled_at.store(0, Ordering::Release);
        }
        Some(decided)
    }

    /// Everything owed has been charged, at `now`: the hold on keys admitted alone starts.
    pub fn settled(&self, now: Micros) {
        let _ =
            self.settled_at
                .compare_exchange(0, now.max(1), Ordering::AcqRel, Ordering::Acquire);
    }

    /// Whether `key` was admitted alone in a window that has not ended at `now`, and is still
    /// held within the local share.
    pub fn alone(&self, key: &str, now: Micros) -> bool {
        if !self.any_alone.load(Ordering::Acquire) {
            return false;
        }
        let settled = self.settled_at.load(Ordering::Acquire);
        if settled != 0 && now >= settled.saturating_add(HOLD) {
            return false;
        }
        let mut entries = lock(&self.owed);
        match entries.alone.get(key) {
            Some(&until) if until > now => true,
            Some(_) => {
                entries.alone.remove(key);
                self.any_alone
                    .store(!entries.alone.is_empty(), Ordering::Release);
                false
            }
            None => false,
        }
    }

    /// Up to `most` owed charges that still matter at `now`, taken out of the ledger; those
    /// that no longer matter are dropped.
    pub fn take(&self, most: usize, now: Micros) -> Taken {
        let mut entries = lock(&self.owed);
        let mut dropped = 0;
        entries.by_key.retain(|_, entry| {
            let matters = entry.2 > now;
            if !matters {
                dropped += entry.1;
            }
            matters
        });
        let keys: Vec<String> = entries.by_key.keys().take(most).cloned().collect();
        let owed: Vec<Owed> = keys
            .into_iter()
            .filter_map(|key| {
                let (limit, units, until) = entries.by_key.remove(&key)?;
                Some(Owed {
                    key,
                    limit,
                    units,
                    until,
                })
            })
            .collect();
        entries.full_until = None;
        entries.taken += owed.len();
        self.owes.store(entries.owes(), Ordering::Release);
        Taken { owed, dropped }
    }

    /// `count` charges [`Ledger::take`] took reached the backend.
    pub fn charged(&self, count: usize) {
        let mut entries = lock(&self.owed);
        entries.taken = entries.taken.saturating_sub(count);
        self.owes.store(entries.owes(), Ordering::Release);
    }

    /// Owe again what [`Ledger::take`] took and could not charge: added to what was owed on
    /// the same keys meanwhile, past the bound if need be (it was counted in it before).
    pub fn restore(&self, owed: Vec<Owed>, now: Micros) {
        let mut entries = lock(&self.owed);
        entries.taken = entries.taken.saturating_sub(owed.len());
        for charge in owed {
            if charge.until <= now {
                continue;
            }
            match entries.by_key.get_mut(&charge.key) {
                Some(entry) if entry.0 == charge.limit => {
                    entry.1 += charge.units;
                    entry.2 = entry.2.max(charge.until);
                }
                Some(_) => {}
                None => {
                    entries
                        .by_key
                        .insert(charge.key, (charge.limit, charge.units, charge.until));
                }
            }
        }
        self.owes.store(entries.owes(), Ordering::Release);
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::decision::limit::Unit;

    /// A moment 40 s into a minute, and a second, in the backend's microseconds.
    pub(in crate::service) const T0: Micros = 1_700_000_020_000_000;
    pub(in crate::service) const SECOND: Micros = 1_000_000;

    /// A hit of one unit, enforced, on `key`.
    pub(in crate::service) fn hit(key: &str, limit: Limit) -> Hit {
        Hit {
            key: key.into(),
            limit,
            units: 1,
            role: Role::Enforce,
            permit: None,
        }
    }

    fn verdict(admitted: bool) -> Outcome {
        Outcome {
            admitted,
            remaining: 0,
            reset_after: std::time::Duration::ZERO,
        }
    }

    fn admit(ledger: &Ledger, hits: &[Hit], admitted: &[bool], now: Micros) -> bool {
        let verdicts = admitted.iter().map(|&a| verdict(a)).collect();
        ledger
            .admit(hits, Charging::Atomic, now, || Ok(verdicts))
            .is_some()
    }

    fn sliding(limit: u32) -> Limit {
        Limit {
            algorithm: Algorithm::SlidingWindow,
            ..Limit::fixed(limit, Unit::Minute)
        }
    }

    #[test]
    fn admitted_charges_are_owed_per_key_until_their_window_ends() {
        let ledger = Ledger::new(10);
        let fixed = Limit::fixed(10, Unit::Minute);
        let bucket = Limit {
            algorithm: Algorithm::TokenBucket,
            ..fixed
        };
        // (hits, verdicts, at): a refused request owes nothing under atomic charging; a
        // token bucket's charge is not carried.
        let rows: Vec<(Vec<Hit>, Vec<bool>, Micros)> = vec![
            (vec![hit("a", fixed)], vec![true], T0),
            (
                vec![hit("a", fixed), hit("b", fixed)],
                vec![true, false],
                T0,
            ),
            (
                vec![hit("a", fixed), hit("s", sliding(5))],
                vec![true, true],
                T0 + SECOND,
            ),
            (vec![hit("t", bucket)], vec![true], T0 + SECOND),
            (vec![hit("s", sliding(5))], vec![true], T0 + 5 * SECOND),
        ];
        for (hits, admitted, at) in rows {
            assert!(admit(&ledger, &hits, &admitted, at));
        }
        assert!(ledger.owes());
        let mut taken = ledger.take(10, T0 + 10 * SECOND).owed;
        taken.sort_by(|x, y| x.key.cmp(&y.key));
        let seen: Vec<(&str, u64, Micros)> = taken
            .iter()
            .map(|o| (o.key.as_str(), o.units, o.until))
            .collect();
        // T0 is 40 s into its minute: the fixed window ends 20 s later; the sliding charge
        // matters a minute after its last admission.
        assert_eq!(
            seen,
            [("a", 2, T0 + 20 * SECOND), ("s", 2, T0 + 65 * SECOND)]
        );
        assert!(ledger.owes(), "owed until known charged");
        ledger.charged(taken.len());
        assert!(!ledger.owes());
        let charge = taken[0].hit();
        assert_eq!(
            (
                charge.units,
                charge.limit.requests_per_unit,
                charge.limit.window
            ),
            (2, u32::MAX, 60),
            "charged whatever the count, in the same window"
        );
    }

    #[test]
    fn a_charge_whose_window_ended_is_dropped_and_a_full_ledger_refuses_new_keys() {
        let ledger = Ledger::new(2);
        let fixed = Limit::fixed(10, Unit::Minute);
        assert!(admit(&ledger, &[hit("a", fixed)], &[true], T0));
        assert!(admit(&ledger, &[hit("b", sliding(5))], &[true], T0));
        assert!(
            !admit(&ledger, &[hit("c", fixed)], &[true], T0),
            "full of charges that matter: a new key is refused"
        );
        assert!(
            admit(&ledger, &[hit("a", fixed)], &[true], T0),
            "a key already owed needs no room"
        );
        // Past the fixed window's end its charge no longer matters: room for a new key.
        let later = T0 + 21 * SECOND;
        assert!(admit(&ledger, &[hit("c", fixed)], &[true], later));
        let taken = ledger.take(10, T0 + 200 * SECOND);
        assert!(taken.owed.is_empty());
        assert_eq!(taken.dropped, 2, "b's and c's units, all past");
        // What could not be charged is owed again, with what was owed meanwhile; a key
        // admitted alone stays known as such until its window ends, charged or not.
        let t = T0 + 200 * SECOND;
        assert!(admit(&ledger, &[hit("d", fixed)], &[true], t));
        let taken = ledger.take(10, t).owed;
        assert!(admit(&ledger, &[hit("d", fixed)], &[true], t));
        ledger.restore(taken, t);
        let taken = ledger.take(10, t).owed;
        assert_eq!(taken[0].units, 2);
        ledger.charged(taken.len());
        assert!(!ledger.owes());
        assert!(ledger.alone("d", t));
        // Once everything owed is charged, the hold lasts HOLD, then ends within the window;
        // a new admission alone starts it over.
        ledger.settled(t);
        assert!(ledger.alone("d", t + HOLD - 1));
        assert!(!ledger.alone("d", t + HOLD));
        assert!(admit(&ledger, &[hit("d", fixed)], &[true], t + HOLD));
        assert!(ledger.alone("d", t + 2 * HOLD));
        assert!(!ledger.alone("d", t + 60 * SECOND));
        assert!(!ledger.alone("b", t));
    }
}
