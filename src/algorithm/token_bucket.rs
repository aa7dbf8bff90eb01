//! Token bucket as GCRA: one stored number per key, the theoretical arrival time (TAT).
//!
//! The rate is `requests_per_unit` per unit, so one unit of cost "costs" an emission interval
//! `T = window / requests_per_unit`; the bucket tolerates `burst` hits back to back. A hit of
//! cost n at time t is admitted when `max(TAT, t) + n*T - burst*T <= t`. Refused hits write
//! nothing. O(1) state and no window boundary to exploit.

use std::time::Duration;

use super::{Arithmetic, Micros, window_micros};
use crate::decision::{Cost, Outcome};
use crate::decision::limit::Limit;

pub struct TokenBucket;

/// The theoretical arrival time in microseconds since the epoch (fractional: T rarely
/// divides the window). 0 for a full bucket.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct State {
    pub tat: f64,
}

/// Tolerance for float rounding when turning time into whole units of quota.
const EPSILON: f64 = 1e-6;

fn emission_interval(limit: &Limit) -> Option<f64> {
    (limit.requests_per_unit > 0)
        .then(|| window_micros(limit) as f64 / f64::from(limit.requests_per_unit))
}

impl Arithmetic for TokenBucket {
    type State = State;
    const BURST: bool = true;
    const BATCHES: bool = true;

    fn batch_lapse(limit: &Limit, units: u64) -> Option<Micros> {
        Some(window_micros(limit) * units / u64::from(limit.requests_per_unit.max(1)))
    }

    fn check(state: &State, limit: &Limit, now: Micros, cost: Cost<'_>) -> Outcome {
        let hits = cost.units;
        let refused_for = |after: f64| Outcome {
            admitted: false,
            remaining: 0,
            reset_after: Duration::from_micros(after.max(0.0).ceil() as Micros),
        };
        let window = window_micros(limit) as f64;
        let Some(t) = emission_interval(limit) else {
            return refused_for(window);
        };
        let burst = f64::from(limit.burst);
        let hits = hits as f64;
        if hits > burst {
            return refused_for(window); // can never conform
        }
        let now = now as f64;
        let tat = state.tat.max(now);
        let new_tat = tat + hits * t;
        let allow_at = new_tat - burst * t;
        if now + EPSILON < allow_at {
            return refused_for(allow_at - now);
        }
        Outcome {
            admitted: true,
            remaining: ((now - allow_at) / t + EPSILON).floor().max(0.0) as u32,
            reset_after: Duration::from_micros((new_tat - now).max(0.0).ceil() as Micros),
        }
    }

    fn commit(state: &mut State, limit: &Limit, now: Micros, cost: Cost<'_>) {
        let hits = cost.units;
        if let Some(t) = emission_interval(limit) {
            state.tat = state.tat.max(now as f64) + hits as f64 * t;
        }
    }

    fn expires_at(state: &State, _limit: &Limit) -> Micros {
        state.tat.ceil() as Micros
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::MICROS_PER_SECOND;
    use crate::decision::limit::{Algorithm, Unit};

    const T0: Micros = 1_700_000_000 * MICROS_PER_SECOND;
    const SEC: Micros = MICROS_PER_SECOND;

    fn bucket(rate: u32, unit: Unit, burst: u32) -> Limit {
        Limit {
            requests_per_unit: rate,
            unit,
            algorithm: Algorithm::TokenBucket,
            burst,
            window: unit.seconds(),
            quota_lease: 0,
        }
    }

    fn run(state: &mut State, limit: &Limit, now: Micros, hits: u64) -> Outcome {
        crate::algorithm::run::<TokenBucket>(state, limit, now, Cost::units(hits))
    }

    #[test]
    fn admits_the_burst_then_the_steady_rate() {
        let l = bucket(10, Unit::Second, 3); // T = 100 ms
        let mut s = State::default();
        let burst: Vec<_> = (0..3).map(|_| run(&mut s, &l, T0, 1).remaining).collect();
        assert_eq!(burst, [2, 1, 0]);
        let refused = run(&mut s, &l, T0, 1);
        assert!(!refused.admitted);
        assert_eq!(refused.reset_after, Duration::from_micros(100_000), "one emission interval");
        assert!(!run(&mut s, &l, T0 + 99_999, 1).admitted);
        assert!(run(&mut s, &l, T0 + 100_000, 1).admitted);
        // Over one second of steady demand, about the rate gets through.
        let admitted = (1..=100)
            .filter(|i| run(&mut s, &l, T0 + 100_000 + i * 10_000, 1).admitted)
            .count();
        assert_eq!(admitted, 10);
    }

    #[test]
    fn refused_hits_write_nothing_and_reset_is_time_to_full() {
        let l = bucket(60, Unit::Minute, 60);
        let mut s = State::default();
        let first = run(&mut s, &l, T0, 1);
        assert_eq!((first.remaining, first.reset_after), (59, Duration::from_micros(SEC)));
        let before = s;
        assert!(!run(&mut s, &l, T0, 60).admitted);
        assert_eq!(s, before);
        assert_eq!(TokenBucket::expires_at(&s, &l), T0 + SEC);
    }

    #[test]
    fn zero_rate_and_oversized_hits_are_refused_with_a_whole_window() {
        let mut s = State::default();
        let zero = run(&mut s, &bucket(0, Unit::Hour, 1), T0, 1);
        assert_eq!((zero.admitted, zero.reset_after), (false, Duration::from_micros(3_600 * SEC)));
        let big = run(&mut s, &bucket(5, Unit::Second, 5), T0, 6);
        assert_eq!((big.admitted, big.reset_after), (false, Duration::from_micros(SEC)));
    }

    #[test]
    fn uneven_intervals_do_not_drift() {
        let l = bucket(3, Unit::Second, 1); // T = 333333.33 us
        let mut s = State::default();
        let admitted = (0..3_000)
            .filter(|i| run(&mut s, &l, T0 + i * 1_000, 1).admitted)
            .count();
        assert_eq!(admitted, 9, "3 per second over 3 s");
    }
}
