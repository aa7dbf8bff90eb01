//! The algorithms, one file each, behind one trait.
//!
//! An algorithm is pure arithmetic over one key's state: `check` decides without writing,
//! `commit` records an admitted hit. Keeping the two apart is what lets a backend evaluate
//! every descriptor of a request first and charge none of them when one refuses. Each
//! algorithm also ships the Lua twin of the same arithmetic (`lua/<name>.lua`), which the
//! Redis backend runs on Redis time; the memory backend calls the Rust side directly.

pub mod concurrency;
pub mod fixed_window;
pub mod sliding_window;
pub mod token_bucket;

use crate::limit::Limit;

/// Microseconds since the Unix epoch: the clock every algorithm reads.
pub type Micros = u64;

pub const MICROS_PER_SECOND: u64 = 1_000_000;

/// What an algorithm says about one hit, before anything is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub admitted: bool,
    /// Units left once this hit is recorded (0 when refused).
    pub remaining: u32,
    /// Admitted: time until the state is back to full quota. Refused: time until a hit of
    /// the same cost would be admitted (the exact retry time).
    pub reset_after: Micros,
}

/// What a concurrency limit's hit does with its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeaseOp {
    /// Take a lease for the request (a request's call on the request path).
    Acquire,
    /// Give it back (Envoy's call when the stream is done, with negative hits).
    Release,
}

/// What one hit asks of an algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cost<'a> {
    /// Units to charge; 0 reads without charging.
    pub units: u64,
    /// For a concurrency limit: the request's lease and what to do with it.
    pub lease: Option<(LeaseOp, &'a str)>,
}

impl Cost<'_> {
    /// A plain cost of `units`, with no lease.
    pub fn units(units: u64) -> Cost<'static> {
        Cost { units, lease: None }
    }
}

/// One algorithm's arithmetic. Implementations are stateless; the state lives in a backend.
pub trait Algorithm {
    /// One key's state. `Default` is the state of a key never hit (or expired).
    type State: Default;

    /// The Lua twin of `check`/`commit`, registered in the Redis batch driver.
    const LUA: &'static str;

    /// Decide whether `cost` fits, without changing anything.
    fn check(state: &Self::State, limit: &Limit, now: Micros, cost: Cost<'_>) -> Verdict;

    /// Record a `cost` that `check` admitted at the same `now` (or a lease release, which
    /// always applies).
    fn commit(state: &mut Self::State, limit: &Limit, now: Micros, cost: Cost<'_>);

    /// The instant after which the state is equivalent to `Default`, so it can be dropped.
    fn expires_at(state: &Self::State, limit: &Limit) -> Micros;
}

/// Length of a limit's window in microseconds.
pub(crate) fn window_micros(limit: &Limit) -> Micros {
    limit.window * MICROS_PER_SECOND
}

/// Check, and commit what is admitted: one hit as a backend applies it (for the tests).
#[cfg(test)]
pub(crate) fn run<A: Algorithm>(
    state: &mut A::State,
    limit: &Limit,
    now: Micros,
    cost: Cost<'_>,
) -> Verdict {
    let v = A::check(state, limit, now, cost);
    if v.admitted {
        A::commit(state, limit, now, cost);
    }
    v
}

/// Saturating conversion for `remaining`, which the protocol carries as u32.
pub(crate) fn clamp_u32(value: u64) -> u32 {
    u32::try_from(value).unwrap_or(u32::MAX)
}
