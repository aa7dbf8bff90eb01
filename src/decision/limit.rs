//! What a backend enforces: a rate (requests per unit), the algorithm that enforces it, and
//! the burst a token bucket tolerates.
//!
//! These types sit between the rules (which produce them) and the backends (which only ever
//! see them), so neither side depends on the other. The registry of algorithms is here too,
//! at the bottom of the layers, since `Limit` names an `Algorithm` and the algorithms read a `Limit`.

use std::fmt;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as ProtoUnit;

/// The time unit of a limit. Windows are aligned to the Unix epoch, as the reference server
/// does; month and year are fixed 30-day and 365-day spans, never calendar months.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Unit {
    pub const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    /// Length of one unit in seconds.
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 604_800,
            Unit::Month => 2_592_000,
            Unit::Year => 31_536_000,
        }
    }

    /// The YAML spelling, matched case-insensitively as the reference does.
    pub fn parse(name: &str) -> Option<Unit> {
        Unit::ALL
            .into_iter()
            .find(|u| u.name().eq_ignore_ascii_case(name))
    }

    /// Upper-case name, as in the protobuf enum and the reference's `/rlconfig`.
    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "SECOND",
            Unit::Minute => "MINUTE",
            Unit::Hour => "HOUR",
            Unit::Day => "DAY",
            Unit::Week => "WEEK",
            Unit::Month => "MONTH",
            Unit::Year => "YEAR",
        }
    }

    pub fn to_proto(self) -> ProtoUnit {
        match self {
            Unit::Second => ProtoUnit::Second,
            Unit::Minute => ProtoUnit::Minute,
            Unit::Hour => ProtoUnit::Hour,
            Unit::Day => ProtoUnit::Day,
            Unit::Week => ProtoUnit::Week,
            Unit::Month => ProtoUnit::Month,
            Unit::Year => ProtoUnit::Year,
        }
    }

    /// `None` for `UNKNOWN` and values outside the enum: a request override with such a unit
    /// is invalid input (the reference panics on it).
    pub fn from_proto(value: i32) -> Option<Unit> {
        match ProtoUnit::try_from(value).ok()? {
            ProtoUnit::Unknown => None,
            ProtoUnit::Second => Some(Unit::Second),
            ProtoUnit::Minute => Some(Unit::Minute),
            ProtoUnit::Hour => Some(Unit::Hour),
            ProtoUnit::Day => Some(Unit::Day),
            ProtoUnit::Week => Some(Unit::Week),
            ProtoUnit::Month => Some(Unit::Month),
            ProtoUnit::Year => Some(Unit::Year),
        }
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The registry of algorithms: every algorithm once, as `Variant module`, where
/// `src/algorithm/<module>.rs` holds its arithmetic (the type `Variant`, implementing
/// `algorithm::Arithmetic`) and `lua/<module>.lua` its Redis twin, and `<module>` is its name
/// in the rules (`algorithm:`). This list is the only one: `Algorithm` below, and in
/// `crate::algorithm` the modules, the twins' sources and the dispatch from an `Algorithm` to its
/// arithmetic and state, are all expanded from it, so a missing file or trait impl is a
/// compile error.
///
/// Expands `$then! { $( #[attrs] Variant module, )+ }`.
macro_rules! algorithms {
    ($then:ident) => {
        $then! {
            /// Counter per epoch-aligned window, as the reference counts. Up to 2x the limit
            /// can pass in a span of one window that straddles a boundary.
            #[default]
            FixedWindow fixed_window,
            /// Exact log of admissions: never more than the limit in any interval of one
            /// window.
            SlidingWindow sliding_window,
            /// GCRA: a token bucket stored as one theoretical arrival time; `burst` back to
            /// back, then the steady rate.
            TokenBucket token_bucket,
            /// At most `requests_per_unit` requests in flight; each permit lasts at most one
            /// window.
            Concurrency concurrency,
        }
    };
}
pub(crate) use algorithms;

/// Declares `Algorithm` from the registry.
macro_rules! algorithm_enum {
    ($($(#[$attr:meta])* $kind:ident $module:ident,)+) => {
        /// How a limit is enforced: which algorithm. Chosen per rule with the additive YAML
        /// field `algorithm:`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub enum Algorithm {
            $($(#[$attr])* $kind,)+
        }

        impl Algorithm {
            pub const ALL: [Algorithm; [$(Algorithm::$kind),+].len()] = [$(Algorithm::$kind),+];

            /// The name in the rules, which is also the algorithm's module and Lua file.
            pub fn name(self) -> &'static str {
                match self {
                    $(Algorithm::$kind => stringify!($module),)+
                }
            }
        }
    };
}
algorithms!(algorithm_enum);

impl Algorithm {
    pub fn parse(name: &str) -> Option<Algorithm> {
        Algorithm::ALL.into_iter().find(|a| a.name() == name)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A limit as a backend enforces it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    pub requests_per_unit: u32,
    pub unit: Unit,
    pub algorithm: Algorithm,
    /// Requests a token bucket admits back to back; equal to `requests_per_unit` unless the
    /// rule says otherwise. Unused by the window algorithms.
    pub burst: u32,
    /// The span `requests_per_unit` applies to, in seconds: the unit's length, unless the
    /// rule sets a custom `window` (then `unit` is only what answers report).
    pub window: u64,
    /// Units an instance takes from a shared backend per round trip and spends locally
    /// (the rule's `lease`; 0 or 1: every hit asks the backend). Not a hit's concurrency
    /// permit (`Hit::permit`), which is one request in flight.
    pub quota_lease: u32,
}

impl Limit {
    /// A limit as the reference understands it: fixed window, no burst of its own.
    pub fn fixed(requests_per_unit: u32, unit: Unit) -> Limit {
        Limit {
            requests_per_unit,
            unit,
            algorithm: Algorithm::FixedWindow,
            burst: requests_per_unit,
            window: unit.seconds(),
            quota_lease: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_parse_case_insensitively_and_round_trip_through_proto() {
        assert_eq!(Unit::parse("minute"), Some(Unit::Minute));
        assert_eq!(Unit::parse("WeEk"), Some(Unit::Week));
        assert_eq!(Unit::parse("fortnight"), None);
        for unit in Unit::ALL {
            assert_eq!(Unit::from_proto(unit.to_proto() as i32), Some(unit));
        }
        assert_eq!(Unit::from_proto(0), None);
        assert_eq!(Unit::from_proto(99), None);
    }

    #[test]
    fn month_and_year_are_fixed_spans() {
        assert_eq!(Unit::Month.seconds(), 30 * 86_400);
        assert_eq!(Unit::Year.seconds(), 365 * 86_400);
    }
}
