//! What the shared backend last said was left of each key's limit, kept for the `local`
//! failure policy: an instance that falls back starts each key from its share of what was
//! left, not from a share of the whole limit, which would let the fleet admit a whole limit
//! again in a window it had already partly spent.
//!
//! Only the window algorithms' answers are kept (as the ledger carries only their charges),
//! and only while they say something: to a fixed window's end, or one window after a sliding
//! window's answer. The map is bounded; when it is full of answers that still say something,
//! a new key is not kept, and falls back to a share of its whole limit.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::algorithm::Micros;
use crate::decision::limit::Limit;
use crate::decision::{Hit, Outcome};
use crate::service::ledger::{carried, matters_until};

const SHARDS: usize = 16;

/// One key's last answer: its limit, what was left, and until when that says anything.
#[derive(Clone, Copy)]
struct Seen {
    limit: Limit,
    remaining: u32,
    until: Micros,
}

#[derive(Default)]
struct Shard {
    by_key: HashMap<String, Seen>,
    /// In a shard found full, the earliest time an answer stops saying anything.
    full_until: Option<Micros>,
}

pub struct Learned {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    max_per_shard: usize,
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Learned {
    /// At most about `max` keys.
    pub fn new(max: usize) -> Learned {
        Learned {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            max_per_shard: max.div_ceil(SHARDS),
        }
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, Shard> {
        lock(&self.shards[self.hasher.hash_one(key) as usize % SHARDS])
    }

    /// Keep what the backend answered on `hits` at `now`.
    pub fn remember(&self, hits: &[Hit], outcomes: &[Outcome], now: Micros) {
        for (hit, outcome) in hits.iter().zip(outcomes) {
            if !carried(hit) || self.max_per_shard == 0 {
                continue;
            }
            let seen = Seen {
                limit: hit.limit,
                remaining: outcome.remaining,
                until: matters_until(&hit.limit, now),
            };
            let mut shard = self.shard(&hit.key);
            if let Some(entry) = shard.by_key.get_mut(&hit.key) {
                *entry = seen;
                continue;
            }
            if shard.by_key.len() >= self.max_per_shard {
                if shard.full_until.is_some_and(|until| now < until) {
                    continue;
                }
                shard.by_key.retain(|_, seen| seen.until > now);
                let full = shard.by_key.len() >= self.max_per_shard;
                shard.full_until = full
                    .then(|| shard.by_key.values().map(|seen| seen.until).min())
                    .flatten();
                if full {
                    continue;
                }
            }
            shard.by_key.insert(hit.key.clone(), seen);
        }
    }

    /// What was last left of `hit`'s limit, if that still says something at `now`; it is
    /// taken, so only the first local decision on the key starts from it.
    pub fn recall(&self, hit: &Hit, now: Micros) -> Option<u32> {
        let seen = self.shard(&hit.key).by_key.remove(&hit.key)?;
        (seen.limit == hit.limit && seen.until > now).then_some(seen.remaining)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::limit::{Algorithm, Unit};
    use crate::service::ledger::tests::{SECOND, T0, hit};
    use std::time::Duration;

    fn left(remaining: u32) -> Outcome {
        Outcome {
            admitted: true,
            remaining,
            reset_after: Duration::ZERO,
        }
    }

    #[test]
    fn the_last_answer_is_recalled_once_while_its_window_lasts() {
        let fixed = Limit::fixed(10, Unit::Minute);
        let bucket = Limit {
            algorithm: Algorithm::TokenBucket,
            ..fixed
        };
        let learned = Learned::new(100);
        learned.remember(
            &[hit("a", fixed), hit("t", bucket)],
            &[left(7), left(3)],
            T0,
        );
        learned.remember(&[hit("a", fixed)], &[left(6)], T0 + SECOND);
        // (key, limit, at, expected): the latest answer, once; none for a token bucket; none
        // past the window (T0 is 40 s into its minute) or for another limit.
        let rows = [
            ("a", fixed, T0 + 2 * SECOND, Some(6)),
            ("a", fixed, T0 + 2 * SECOND, None),
            ("t", bucket, T0, None),
        ];
        for (key, limit, at, expected) in rows {
            assert_eq!(learned.recall(&hit(key, limit), at), expected, "{key}");
        }
        learned.remember(&[hit("b", fixed)], &[left(4)], T0);
        assert_eq!(learned.recall(&hit("b", fixed), T0 + 20 * SECOND), None);
        learned.remember(&[hit("c", fixed)], &[left(4)], T0);
        let other = Limit::fixed(20, Unit::Minute);
        assert_eq!(learned.recall(&hit("c", other), T0), None);
    }

    #[test]
    fn a_full_map_keeps_no_new_key_until_an_answer_expires() {
        // One key per shard at most.
        let learned = Learned::new(SHARDS);
        let fixed = Limit::fixed(10, Unit::Minute);
        let keys: Vec<String> = (0..200).map(|n| format!("k{n}")).collect();
        for key in &keys {
            learned.remember(&[hit(key, fixed)], &[left(1)], T0);
        }
        let kept = |at| {
            keys.iter()
                .filter(|k| learned.recall(&hit(k, fixed), at).is_some())
                .count()
        };
        assert_eq!(kept(T0), SHARDS);
        for key in &keys {
            learned.remember(&[hit(key, fixed)], &[left(1)], T0);
        }
        // The next minute, the old answers are dropped to make room.
        for key in &keys {
            learned.remember(&[hit(key, fixed)], &[left(1)], T0 + 30 * SECOND);
        }
        assert_eq!(kept(T0 + 30 * SECOND), SHARDS);
    }
}
