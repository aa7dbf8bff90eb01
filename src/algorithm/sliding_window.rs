//! Sliding window log: every admission is remembered for one window, so no interval of one
//! window's length ever holds more than the limit, whatever the number of instances.
//!
//! The price is state proportional to the limit (one entry per admission; a hit of cost n is
//! one entry carrying n), which is why the rules cap `requests_per_unit` for this algorithm.

use std::collections::VecDeque;
use std::time::Duration;

use super::{Arithmetic, Micros, clamp_u32, window_micros};
use crate::decision::{Cost, Outcome};
use crate::decision::limit::Limit;

pub struct SlidingWindow;

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct State {
    /// Admissions, oldest first: (time, cost).
    entries: VecDeque<(Micros, u64)>,
    /// Sum of the costs in `entries`.
    total: u64,
}

impl State {
    /// Entries still inside the window that ends at `now` (an entry leaves exactly one
    /// window after it was admitted).
    fn live(&self, limit: &Limit, now: Micros) -> impl Iterator<Item = &(Micros, u64)> {
        let horizon = now.saturating_sub(window_micros(limit));
        self.entries
            .iter()
            .skip_while(move |(at, _)| *at <= horizon)
    }

    /// Sum of the live costs: the running total less the entries that have left the window,
    /// as the Lua twin keeps its `:n` sum, so a check reads only the expired head of the log.
    fn live_total(&self, limit: &Limit, now: Micros) -> u64 {
        let horizon = now.saturating_sub(window_micros(limit));
        let expired: u64 = self
            .entries
            .iter()
            .take_while(|(at, _)| *at <= horizon)
            .map(|(_, cost)| cost)
            .sum();
        self.total - expired
    }

    fn trim(&mut self, limit: &Limit, now: Micros) {
        let horizon = now.saturating_sub(window_micros(limit));
        while let Some(&(at, cost)) = self.entries.front() {
            if at > horizon {
                break;
            }
            self.entries.pop_front();
            self.total -= cost;
        }
    }
}

impl Arithmetic for SlidingWindow {
    type State = State;
    /// One log entry per admission.
    const MAX_LIMIT: Option<u32> = Some(10_000);

    fn heap_bytes(state: &State) -> usize {
        state.entries.capacity() * std::mem::size_of::<(Micros, u64)>()
    }

    fn check(state: &State, limit: &Limit, now: Micros, cost: Cost<'_>) -> Outcome {
        let hits = cost.units;
        let window = window_micros(limit);
        let limit_units = u64::from(limit.requests_per_unit);
        let live_total = state.live_total(limit, now);
        let after = live_total.saturating_add(hits);
        if after <= limit_units {
            let newest = if hits > 0 {
                Some(now)
            } else {
                state.live(limit, now).last().map(|(at, _)| *at)
            };
            return Outcome {
                admitted: true,
                remaining: clamp_u32(limit_units - after),
                reset_after: Duration::from_micros(newest.map_or(0, |at| at + window - now)),
            };
        }
        // Refused: wait until enough of the oldest entries have aged out.
        let reset_after = if hits > limit_units {
            window // can never fit; report a whole window
        } else {
            let must_free = after - limit_units;
            let mut freed = 0;
            state
                .live(limit, now)
                .find(|(_, cost)| {
                    freed += cost;
                    freed >= must_free
                })
                .map_or(window, |(at, _)| at + window - now)
        };
        Outcome {
            admitted: false,
            remaining: 0,
            reset_after: Duration::from_micros(reset_after),
        }
    }

    fn commit(state: &mut State, limit: &Limit, now: Micros, cost: Cost<'_>) {
        let hits = cost.units;
        state.trim(limit, now);
        if hits > 0 {
            state.entries.push_back((now, hits));
            state.total += hits;
        }
    }

    fn expires_at(state: &State, limit: &Limit) -> Micros {
        state
            .entries
            .back()
            .map_or(0, |(at, _)| at + window_micros(limit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::MICROS_PER_SECOND;
    use crate::decision::limit::{Algorithm, Unit};

    const T0: Micros = 1_700_000_000 * MICROS_PER_SECOND;
    const SEC: Micros = MICROS_PER_SECOND;

    fn limit(n: u32) -> Limit {
        Limit {
            algorithm: Algorithm::SlidingWindow,
            ..Limit::fixed(n, Unit::Second)
        }
    }

    fn run(state: &mut State, limit: &Limit, now: Micros, hits: u64) -> Outcome {
        crate::algorithm::run::<SlidingWindow>(state, limit, now, Cost::units(hits))
    }

    #[test]
    fn never_more_than_the_limit_in_any_window_even_across_a_boundary() {
        let l = limit(5);
        let mut s = State::default();
        let mut admitted_at = Vec::new();
        // One attempt every 50 ms for 3 s.
        for i in 0..60 {
            let now = T0 + i * 50_000;
            if run(&mut s, &l, now, 1).admitted {
                admitted_at.push(now);
            }
        }
        for (i, start) in admitted_at.iter().enumerate() {
            let in_window = admitted_at[i..]
                .iter()
                .take_while(|&&at| at < start + SEC)
                .count();
            assert!(
                in_window <= 5,
                "{in_window} admissions within 1 s of {start}"
            );
        }
        assert_eq!(admitted_at.len(), 15, "5 per second over 3 s");
    }

    #[test]
    fn retry_time_is_when_the_oldest_entry_ages_out() {
        let l = limit(2);
        let mut s = State::default();
        run(&mut s, &l, T0, 1);
        run(&mut s, &l, T0 + 300_000, 1);
        let refused = run(&mut s, &l, T0 + 500_000, 1);
        assert!(!refused.admitted);
        assert_eq!(refused.reset_after, Duration::from_micros(500_000));
        // One microsecond early is still refused; on time is admitted.
        assert!(!run(&mut s, &l, T0 + SEC - 1, 1).admitted);
        assert!(run(&mut s, &l, T0 + SEC, 1).admitted);
    }

    #[test]
    fn weighted_hits_free_enough_capacity_before_retry() {
        let l = limit(10);
        let mut s = State::default();
        run(&mut s, &l, T0, 4);
        run(&mut s, &l, T0 + 100_000, 4);
        let refused = run(&mut s, &l, T0 + 200_000, 6);
        assert!(!refused.admitted);
        // 8 + 6 = 14: 4 must go, so the first entry's expiry is enough.
        assert_eq!(refused.reset_after, Duration::from_micros(SEC - 200_000));
        let never = run(&mut s, &l, T0 + 200_000, 11);
        assert_eq!(never.reset_after, Duration::from_micros(SEC));
    }

    #[test]
    fn state_is_trimmed_and_expires_one_window_after_the_newest_entry() {
        let l = limit(3);
        let mut s = State::default();
        run(&mut s, &l, T0, 1);
        run(&mut s, &l, T0 + 2 * SEC, 1);
        assert_eq!(s.entries.len(), 1);
        assert_eq!(SlidingWindow::expires_at(&s, &l), T0 + 3 * SEC);
        let read = run(&mut s, &l, T0 + 2 * SEC, 0);
        assert_eq!((read.remaining, read.reset_after), (2, Duration::from_micros(SEC)));
    }
}
