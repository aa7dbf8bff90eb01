//! Fixed window: one counter per epoch-aligned window, as the reference server counts.
//!
//! The window of a hit at time `t` starts at `floor(t / W) * W` seconds since the epoch, so
//! every instance (and the Go server, during a migration) lands on the same counter. Cheap
//! and familiar; its known weakness is up to 2x the limit in a span of one window that
//! straddles a boundary.

use std::time::Duration;

use super::{Arithmetic, MICROS_PER_SECOND, Micros, clamp_u32};
use crate::decision::{Cost, Outcome};
use crate::decision::limit::Limit;

pub struct FixedWindow;

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct State {
    /// Start of the counted window, in seconds since the epoch.
    pub window_start: u64,
    pub count: u64,
}

/// Start (seconds since the epoch) of the window that holds `now`.
pub fn window_start(limit: &Limit, now: Micros) -> u64 {
    let w = limit.window;
    now / MICROS_PER_SECOND / w * w
}

impl Arithmetic for FixedWindow {
    type State = State;
    const BATCHES: bool = true;

    fn check(state: &State, limit: &Limit, now: Micros, cost: Cost<'_>) -> Outcome {
        let hits = cost.units;
        let start = window_start(limit, now);
        let count = if state.window_start == start {
            state.count
        } else {
            0
        };
        let after = count.saturating_add(hits);
        let admitted = after <= u64::from(limit.requests_per_unit);
        let window_end = (start + limit.window) * MICROS_PER_SECOND;
        Outcome {
            admitted,
            remaining: if admitted {
                clamp_u32(u64::from(limit.requests_per_unit) - after)
            } else {
                0
            },
            reset_after: Duration::from_micros(window_end - now),
        }
    }

    fn commit(state: &mut State, limit: &Limit, now: Micros, cost: Cost<'_>) {
        let hits = cost.units;
        let start = window_start(limit, now);
        if state.window_start != start {
            *state = State {
                window_start: start,
                count: 0,
            };
        }
        state.count = state.count.saturating_add(hits);
    }

    fn expires_at(state: &State, limit: &Limit) -> Micros {
        (state.window_start + limit.window) * MICROS_PER_SECOND
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::limit::Unit;

    const T0: Micros = 1_699_999_980 * MICROS_PER_SECOND; // a minute boundary

    fn run(state: &mut State, limit: &Limit, now: Micros, hits: u64) -> Outcome {
        crate::algorithm::run::<FixedWindow>(state, limit, now, Cost::units(hits))
    }

    #[test]
    fn counts_down_then_refuses_until_the_window_ends() {
        let limit = Limit::fixed(3, Unit::Minute);
        let mut s = State::default();
        let now = T0 + 20 * MICROS_PER_SECOND;
        let remaining: Vec<_> = (0..3).map(|_| run(&mut s, &limit, now, 1)).collect();
        assert_eq!(
            remaining.iter().map(|v| v.remaining).collect::<Vec<_>>(),
            [2, 1, 0]
        );
        let refused = run(&mut s, &limit, now, 1);
        assert!(!refused.admitted);
        assert_eq!(refused.reset_after, Duration::from_micros(40 * MICROS_PER_SECOND));
        // A refused hit is not recorded.
        assert_eq!(s.count, 3);
        // The next window starts from zero.
        let next = run(&mut s, &limit, T0 + 60 * MICROS_PER_SECOND, 1);
        assert!(next.admitted);
        assert_eq!(next.remaining, 2);
    }

    #[test]
    fn zero_hits_reads_without_consuming() {
        let limit = Limit::fixed(1, Unit::Second);
        let mut s = State::default();
        assert!(run(&mut s, &limit, T0, 0).admitted);
        assert_eq!(s.count, 0);
        assert!(run(&mut s, &limit, T0, 1).admitted);
        let read = run(&mut s, &limit, T0, 0);
        assert!(read.admitted, "at the limit, not over it");
        assert_eq!(read.remaining, 0);
    }

    #[test]
    fn a_limit_of_zero_refuses_everything_and_huge_hits_do_not_overflow() {
        let mut s = State::default();
        assert!(!run(&mut s, &Limit::fixed(0, Unit::Hour), T0, 1).admitted);
        assert!(!run(&mut s, &Limit::fixed(u32::MAX, Unit::Hour), T0, u64::MAX).admitted);
    }

    #[test]
    fn admits_twice_the_limit_across_a_boundary() {
        let limit = Limit::fixed(5, Unit::Second);
        let mut s = State::default();
        let before = T0 - 1_000;
        let after = T0 + 1_000;
        let admitted = [before; 5]
            .into_iter()
            .chain([after; 5])
            .filter(|&now| run(&mut s, &limit, now, 1).admitted)
            .count();
        assert_eq!(admitted, 10, "the known weakness of fixed windows");
    }
}
