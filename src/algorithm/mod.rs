//! The algorithms, one file each, behind one trait.
//!
//! An algorithm is pure arithmetic over one key's state: `check` decides without writing,
//! `commit` records an admitted hit. Keeping the two apart is what lets a backend evaluate
//! every descriptor of a request first and charge none of them when one refuses. Each
//! algorithm also has the Lua twin of the same arithmetic (`lua/<name>.lua`), which the
//! Redis backend runs on Redis time; the memory backend calls the Rust side directly.
//!
//! Which algorithms exist is said once, in the registry `crate::decision::limit::algorithms!`; this
//! module expands it into the modules, the twins' sources (`Algorithm::lua`), the state of any
//! algorithm (`KeyState`) and the dispatch from an `Algorithm` to its arithmetic, so that nothing
//! else matches on every `Algorithm`. Adding an algorithm is one line there, `<name>.rs` here
//! (with its `Arithmetic` impl) and `lua/<name>.lua`; the compiler reports any of them missing.

use crate::decision::limit::{Algorithm, Limit, algorithms};
use crate::decision::{Cost, Outcome};

/// Microseconds since the Unix epoch: the clock every algorithm reads.
pub type Micros = u64;

pub const MICROS_PER_SECOND: u64 = 1_000_000;

/// One algorithm's arithmetic. Implementations are stateless; the state lives in a backend.
pub trait Arithmetic {
    /// One key's state. `Default` is the state of a key never hit (or expired).
    type State: Default + Clone + std::fmt::Debug;

    /// Whether a rule may set `burst`: hits admitted back to back, above the steady rate.
    const BURST: bool = false;

    /// Whether a rule may set `lease`: an instance takes units from a shared backend ahead
    /// and spends them locally, which fits only state that counts units, whoever spends them.
    const BATCHES: bool = false;

    /// The largest `requests_per_unit` a rule may set, for state that grows with it.
    const MAX_LIMIT: Option<u32> = None;

    /// For an algorithm that `BATCHES`: the longest an instance may keep `units` taken ahead
    /// unspent (`None`: until the granted hit's reset). A token bucket's must lapse once the
    /// bucket would have earned them again, or they would pile up into a burst it refuses.
    fn batch_lapse(_limit: &Limit, _units: u64) -> Option<Micros> {
        None
    }

    /// Whether it limits requests in flight (each holding a permit named by the descriptor's
    /// last entry) rather than a rate.
    const IN_FLIGHT: bool = false;

    /// Decide whether `cost` fits, without changing anything.
    fn check(state: &Self::State, limit: &Limit, now: Micros, cost: Cost<'_>) -> Outcome;

    /// Record a `cost` that `check` admitted at the same `now` (or a permit release, which
    /// always applies).
    fn commit(state: &mut Self::State, limit: &Limit, now: Micros, cost: Cost<'_>);

    /// The instant after which the state is equivalent to `Default`, so it can be dropped.
    fn expires_at(state: &Self::State, limit: &Limit) -> Micros;

    /// The bytes the state holds on the heap, for a backend that caps the bytes of the state
    /// it keeps: state that grows with admissions (a log, permits) counts, not only its key.
    fn heap_bytes(_state: &Self::State) -> usize {
        0
    }
}

/// Expands the registry: the modules, and what each `Algorithm` stands for.
macro_rules! expand {
    ($($(#[$attr:meta])* $kind:ident $module:ident,)+) => {
        $(pub mod $module;)+

        /// One key's state, whatever its algorithm: what a backend keeping state in process
        /// stores.
        #[derive(Debug, Clone)]
        pub enum KeyState {
            $($kind(<$module::$kind as Arithmetic>::State),)+
        }

        impl KeyState {
            /// Decide whether `cost` fits `limit` on `state`, without changing anything. No
            /// state, or one of another algorithm (the rule changed), reads as a fresh key's.
            pub fn check(
                state: Option<&KeyState>,
                limit: &Limit,
                now: Micros,
                cost: Cost<'_>,
            ) -> Outcome {
                match (limit.algorithm, state) {
                    $(
                        (Algorithm::$kind, Some(KeyState::$kind(state))) => {
                            $module::$kind::check(state, limit, now, cost)
                        }
                        (Algorithm::$kind, _) => {
                            $module::$kind::check(&Default::default(), limit, now, cost)
                        }
                    )+
                }
            }

            /// Record `cost` (as [`Arithmetic::commit`]) on `state`, which starts afresh when
            /// empty or of another algorithm. Returns when the state expires.
            pub fn commit(
                state: &mut Option<KeyState>,
                limit: &Limit,
                now: Micros,
                cost: Cost<'_>,
            ) -> Micros {
                match limit.algorithm {
                    $(
                        Algorithm::$kind => {
                            let mut own = match state.take() {
                                Some(KeyState::$kind(own)) => own,
                                _ => Default::default(),
                            };
                            $module::$kind::commit(&mut own, limit, now, cost);
                            let expires_at = $module::$kind::expires_at(&own, limit);
                            *state = Some(KeyState::$kind(own));
                            expires_at
                        }
                    )+
                }
            }

            /// See [`Arithmetic::heap_bytes`].
            pub fn heap_bytes(&self) -> usize {
                match self {
                    $(KeyState::$kind(state) => $module::$kind::heap_bytes(state),)+
                }
            }
        }

        impl Algorithm {
            /// The Lua twin's source: a chunk that returns the algorithm's table of
            /// functions (see `backend::redis::twins`).
            pub fn lua(self) -> &'static str {
                match self {
                    $(
                        Algorithm::$kind => {
                            include_str!(concat!("../../lua/", stringify!($module), ".lua"))
                        }
                    )+
                }
            }

            /// See [`Arithmetic::BURST`].
            pub fn takes_burst(self) -> bool {
                match self {
                    $(Algorithm::$kind => $module::$kind::BURST,)+
                }
            }

            /// See [`Arithmetic::BATCHES`].
            pub fn batches(self) -> bool {
                match self {
                    $(Algorithm::$kind => $module::$kind::BATCHES,)+
                }
            }

            /// See [`Arithmetic::MAX_LIMIT`].
            pub fn max_limit(self) -> Option<u32> {
                match self {
                    $(Algorithm::$kind => $module::$kind::MAX_LIMIT,)+
                }
            }

            /// See [`Arithmetic::batch_lapse`].
            pub fn batch_lapse(self, limit: &Limit, units: u64) -> Option<Micros> {
                match self {
                    $(Algorithm::$kind => $module::$kind::batch_lapse(limit, units),)+
                }
            }

            /// See [`Arithmetic::IN_FLIGHT`].
            pub fn in_flight(self) -> bool {
                match self {
                    $(Algorithm::$kind => $module::$kind::IN_FLIGHT,)+
                }
            }
        }
    };
}
algorithms!(expand);

/// Length of a limit's window in microseconds.
pub(crate) fn window_micros(limit: &Limit) -> Micros {
    limit.window * MICROS_PER_SECOND
}

/// Check, and commit what is admitted: one hit as a backend applies it (for the tests).
#[cfg(test)]
pub(crate) fn run<A: Arithmetic>(
    state: &mut A::State,
    limit: &Limit,
    now: Micros,
    cost: Cost<'_>,
) -> Outcome {
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
