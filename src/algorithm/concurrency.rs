//! Concurrency: at most `requests_per_unit` requests in flight per key, through the plain
//! rate-limit protocol.
//!
//! Envoy calls on the request path (a permit is taken) and, with `apply_on_stream_done` and
//! negative hits, again when the stream ends (the permit is given back). Each permit is named
//! by the request (the descriptor's last entry, e.g. its `x-request-id`), so a stream-done
//! call for a request that was refused gives back nothing, and a repeated call does not take
//! a second permit. A permit also expires one window after it was taken, so a crashed stream
//! or a lost stream-done call cannot leak capacity: the window is the longest a request may
//! hold its permit.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::LazyLock;
use std::time::Duration;

use super::{Arithmetic, Micros, clamp_u32, window_micros};
use crate::decision::{Cost, PermitOp, Outcome};
use crate::decision::limit::Limit;

pub struct Concurrency;

/// Permits in flight: request (its permit's name) → expiry.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct State {
    permits: HashMap<PermitName, Micros>,
}

/// A permit's name: a 128-bit digest of the request's id, keyed at random for each process. A
/// permit then costs the same whatever its id's length (a descriptor value may be KiBs, and a
/// key holds up to 10 000 permits), and no client can pick two ids that share one.
type PermitName = u128;

fn permit_name(id: &str) -> PermitName {
    static KEYS: LazyLock<[RandomState; 2]> =
        LazyLock::new(|| [RandomState::new(), RandomState::new()]);
    let [high, low] = &*KEYS;
    (u128::from(high.hash_one(id)) << 64) | u128::from(low.hash_one(id))
}

impl State {
    fn live(&self, now: Micros) -> impl Iterator<Item = (&PermitName, &Micros)> {
        self.permits.iter().filter(move |(_, expiry)| **expiry > now)
    }

    fn holds(&self, id: &str, now: Micros) -> bool {
        self.permits
            .get(&permit_name(id))
            .is_some_and(|expiry| *expiry > now)
    }
}

impl Arithmetic for Concurrency {
    type State = State;
    const IN_FLIGHT: bool = true;
    /// One permit per request in flight, each named by its request, and every decision reads
    /// them all.
    const MAX_LIMIT: Option<u32> = Some(10_000);

    fn check(state: &State, limit: &Limit, now: Micros, cost: Cost<'_>) -> Outcome {
        let max = u64::from(limit.requests_per_unit);
        let live = state.live(now).count() as u64;
        let window = window_micros(limit);
        let ok = |in_flight: u64| Outcome {
            admitted: true,
            remaining: clamp_u32(max.saturating_sub(in_flight)),
            reset_after: Duration::from_micros(window),
        };
        match cost.permit {
            Some((PermitOp::Release, id)) => ok(live - u64::from(state.holds(id, now))),
            Some((PermitOp::Acquire, id)) if state.holds(id, now) => ok(live),
            Some((PermitOp::Acquire, _)) if cost.units > 0 => {
                if live < max {
                    ok(live + 1)
                } else {
                    // Refused until the oldest permit expires, at the latest (a release can
                    // free a place sooner).
                    let first = state.live(now).map(|(_, e)| *e).min();
                    Outcome {
                        admitted: false,
                        remaining: 0,
                        reset_after: Duration::from_micros(first.map_or(window, |e| e - now)),
                    }
                }
            }
            _ => ok(live),
        }
    }

    fn commit(state: &mut State, limit: &Limit, now: Micros, cost: Cost<'_>) {
        state.permits.retain(|_, expiry| *expiry > now);
        match cost.permit {
            Some((PermitOp::Acquire, id)) => {
                state
                    .permits
                    .insert(permit_name(id), now + window_micros(limit));
            }
            Some((PermitOp::Release, id)) => {
                state.permits.remove(&permit_name(id));
            }
            None => {}
        }
    }

    fn expires_at(state: &State, _limit: &Limit) -> Micros {
        state.permits.values().copied().max().unwrap_or(0)
    }

    /// The map's slots, with their control bytes.
    fn heap_bytes(state: &State) -> usize {
        state.permits.capacity() * (std::mem::size_of::<(PermitName, Micros)>() + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::MICROS_PER_SECOND;
    use crate::decision::limit::{Algorithm, Unit};

    const T0: Micros = 1_700_000_000 * MICROS_PER_SECOND;

    fn run(state: &mut State, limit: &Limit, now: Micros, op: PermitOp, id: &str) -> Outcome {
        let cost = Cost {
            units: 1,
            permit: Some((op, id)),
        };
        crate::algorithm::run::<Concurrency>(state, limit, now, cost)
    }

    #[test]
    fn n_in_flight_then_refusal_until_one_is_released_or_expires() {
        let limit = Limit {
            algorithm: Algorithm::Concurrency,
            ..Limit::fixed(2, Unit::Minute)
        };
        let mut s = State::default();
        let acquire = |s: &mut State, now, id| run(s, &limit, now, PermitOp::Acquire, id);
        assert_eq!(acquire(&mut s, T0, "a").remaining, 1);
        assert_eq!(acquire(&mut s, T0, "b").remaining, 0);
        let refused = acquire(&mut s, T0 + 1, "c");
        assert!(!refused.admitted);
        assert_eq!(
            refused.reset_after,
            Duration::from_micros(60 * MICROS_PER_SECOND - 1),
            "when a's permit expires"
        );
        assert!(
            acquire(&mut s, T0 + 2, "a").admitted,
            "a holds its permit already"
        );
        // A release for a request that holds nothing gives back nothing.
        run(&mut s, &limit, T0 + 3, PermitOp::Release, "c");
        assert!(!acquire(&mut s, T0 + 4, "c").admitted);
        run(&mut s, &limit, T0 + 5, PermitOp::Release, "a");
        assert!(acquire(&mut s, T0 + 6, "c").admitted);
        // Permits expire one window after they were taken.
        assert!(
            acquire(&mut s, T0 + 60 * MICROS_PER_SECOND + 1, "d").admitted,
            "b expired"
        );
    }

    #[test]
    fn a_lease_costs_the_same_whatever_its_request_id() {
        // 100 permits named by 8-byte ids, then by 4 KB ids: the same bytes, and each id
        // still names its own permit (a repeat takes none, a release frees its own).
        let limit = Limit {
            algorithm: Algorithm::Concurrency,
            ..Limit::fixed(10_000, Unit::Hour)
        };
        let bytes = |width: usize| {
            let mut s = State::default();
            for i in 0..100 {
                let id = format!("{i:0width$}");
                assert!(run(&mut s, &limit, T0, PermitOp::Acquire, &id).admitted);
            }
            let held = Concurrency::heap_bytes(&s);
            let repeat = run(&mut s, &limit, T0, PermitOp::Acquire, &format!("{:0width$}", 7));
            assert_eq!(repeat.remaining, 10_000 - 100, "ids of {width} bytes");
            run(&mut s, &limit, T0, PermitOp::Release, &format!("{:0width$}", 7));
            assert_eq!(s.live(T0).count(), 99, "ids of {width} bytes");
            held
        };
        assert_eq!(bytes(8), bytes(4_096));
    }
}
