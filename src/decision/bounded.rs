//! Capacity of a bounded map whose entries go only when they expire (quota leases, cached
//! refusals, RLQS buckets): a new key is let in after the expired entries are dropped.
//!
//! Dropping them is a pass over every entry, so once a pass finds every entry live, a new key
//! is turned away without another pass until the earliest of them expires: otherwise a map
//! full of live entries would be scanned under its lock for every new key.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Instant;

/// When a map found full can next make room. Its owner [`Capacity::clear`]s it when an entry
/// becomes droppable other than by expiring (spent, or removed).
#[derive(Debug, Default, Clone, Copy)]
pub struct Capacity {
    /// The earliest expiry among the live entries of a full map; `None`: room may be made now.
    full_until: Option<Instant>,
}

impl Capacity {
    /// Whether `map`, bounded at `max` entries, has room for a new key at `now`, after
    /// dropping its expired entries if it is full. `expiry` is when an entry expires (`None`:
    /// it may be dropped now).
    pub fn make_room<K: Eq + Hash, V>(
        &mut self,
        map: &mut HashMap<K, V>,
        max: usize,
        now: Instant,
        expiry: impl Fn(&V) -> Option<Instant>,
    ) -> bool {
        if map.len() < max {
            return true;
        }
        if self.full_until.is_some_and(|until| now < until) {
            return false;
        }
        let mut earliest = None::<Instant>;
        map.retain(|_, value| match expiry(value) {
            Some(expires) if expires > now => {
                earliest = Some(earliest.map_or(expires, |e| e.min(expires)));
                true
            }
            _ => false,
        });
        self.full_until = (map.len() >= max).then_some(earliest).flatten();
        map.len() < max
    }

    /// Insert `value` at `key` in `map` (at most `max` entries), unless the key is new and
    /// there is no room for it (see [`Capacity::make_room`]).
    pub fn insert<K: Eq + Hash, V>(
        &mut self,
        map: &mut HashMap<K, V>,
        max: usize,
        (key, value): (K, V),
        now: Instant,
        expiry: impl Fn(&V) -> Option<Instant>,
    ) {
        if map.contains_key(&key) || self.make_room(map, max, now, &expiry) {
            self.kept(expiry(&value));
            map.insert(key, value);
        }
    }

    /// An entry was kept or renewed to expire at `expires` (`None`: droppable now), which
    /// may be before the others.
    pub fn kept(&mut self, expires: Option<Instant>) {
        self.full_until = self.full_until.zip(expires).map(|(a, b)| a.min(b));
    }

    /// An entry became droppable before its expiry.
    pub fn clear(&mut self) {
        self.full_until = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_full_map_is_scanned_again_only_once_an_entry_may_have_gone() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // Entries expire at their value (ms from t0); two at most.
        let expiry = |ms: &u64| Some(at(*ms));
        let mut map: HashMap<&str, u64> = HashMap::from([("a", 10), ("b", 20)]);
        let mut capacity = Capacity::default();
        // Full of live entries: no room, and until `a` expires no pass is made, so `b`,
        // expired meanwhile, stays.
        assert!(!capacity.make_room(&mut map, 2, at(5), expiry));
        map.insert("b", 7);
        assert!(!capacity.make_room(&mut map, 2, at(8), expiry));
        assert_eq!(map.len(), 2, "no pass before `a` expires");
        // Clearing (an entry spent or removed) allows a pass at once.
        capacity.clear();
        assert!(capacity.make_room(&mut map, 2, at(8), expiry));
        assert_eq!(map.keys().collect::<Vec<_>>(), [&"a"]);
        // An entry renewed to expire first brings the next pass forward.
        let mut map: HashMap<&str, u64> = HashMap::from([("x", 50), ("y", 60)]);
        let mut capacity = Capacity::default();
        assert!(!capacity.make_room(&mut map, 2, at(0), expiry));
        map.insert("y", 20);
        capacity.kept(Some(at(20)));
        assert!(!capacity.make_room(&mut map, 2, at(19), expiry));
        assert!(capacity.make_room(&mut map, 2, at(20), expiry));
        assert_eq!(map.keys().collect::<Vec<_>>(), [&"x"]);
        // Inserting: a new key into a full map is turned away, a key already in it renewed
        // (and, renewed to expire first, it brings the next pass forward).
        capacity.insert(&mut map, 1, ("z", 200), at(30), expiry);
        assert_eq!(map, HashMap::from([("x", 50)]));
        capacity.insert(&mut map, 1, ("x", 150), at(30), expiry);
        capacity.insert(&mut map, 1, ("x", 40), at(30), expiry);
        assert_eq!(map, HashMap::from([("x", 40)]));
        capacity.insert(&mut map, 1, ("z", 200), at(39), expiry);
        assert_eq!(map, HashMap::from([("x", 40)]), "no pass before 40");
        capacity.insert(&mut map, 1, ("z", 200), at(40), expiry);
        assert_eq!(map, HashMap::from([("z", 200)]));
        // With capacity to spare, nothing is dropped, expired or not.
        assert!(capacity.make_room(&mut map, 2, at(300), expiry));
        assert_eq!(map.len(), 1);
    }
}
