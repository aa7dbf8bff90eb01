//! The vocabulary every layer shares about one decision: the hits a request becomes and what
//! each asks of an algorithm (`limit`, and `key`, the state a hit lands on), how a refusal
//! charges them, their outcomes, what can go wrong in a backend and what to answer then; and
//! the small bounds every layer applies (`deadline`, a caller's; `bounded`, a map's room).
//!
//! It sits at the bottom and imports no other folder, so that `algorithm`, `ops`, `config`
//! and `backend` never import one another for a word (a rule names a failure policy; a
//! metric counts an outcome) and the layers point one way: vocabulary, then algorithms,
//! metrics and rules, then backends.

pub mod bounded;
pub mod deadline;
pub mod key;
pub mod limit;

use std::fmt;
use std::time::Duration;

use crate::decision::limit::Limit;

/// How a hit's verdict bears on the request's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A refusal refuses the request.
    Enforce,
    /// Counted and reported, never refuses (`shadow_mode`).
    Shadow,
    /// Soft limit: the request is refused only when every quota hit of it is refused.
    Quota,
}

/// One descriptor's share of a request: `units` units against `limit` on the state `key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    pub key: String,
    pub limit: Limit,
    pub units: u64,
    pub role: Role,
    /// For a concurrency limit: the request's permit, taken or given back.
    pub permit: Option<(PermitOp, String)>,
}

impl Hit {
    /// What the algorithm is asked.
    pub fn cost(&self) -> Cost<'_> {
        Cost {
            units: self.units,
            permit: self.permit.as_ref().map(|(op, id)| (*op, id.as_str())),
        }
    }

    /// A permit given back: applied whatever the rest of the request says, since the request
    /// it belonged to is over.
    pub fn releases(&self) -> bool {
        matches!(self.permit, Some((PermitOp::Release, _)))
    }
}

/// What a concurrency limit's hit does with its permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PermitOp {
    /// Take a permit for the request (a request's call on the request path).
    Acquire,
    /// Give it back (Envoy's call when the stream is done, with negative hits).
    Release,
}

/// What one hit asks of an algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cost<'a> {
    /// Units to charge; 0 reads without charging.
    pub units: u64,
    /// For a concurrency limit: the request's permit and what to do with it.
    pub permit: Option<(PermitOp, &'a str)>,
}

impl Cost<'_> {
    /// A plain cost of `units`, with no permit.
    pub fn units(units: u64) -> Cost<'static> {
        Cost {
            units,
            permit: None,
        }
    }
}

/// When a request is refused, what its admitted hits cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Charging {
    /// Nothing: the request is all or nothing (the default).
    #[default]
    Atomic,
    /// Each admitted hit is charged whatever the others say, as the reference does.
    PerDescriptor,
    /// None: the request is already refused elsewhere (a cached refusal). The hits are still
    /// evaluated, for their figures.
    Nothing,
}

impl Charging {
    /// Whether a request whose hits got `verdicts` is charged.
    pub fn charges(self, hits: &[Hit], verdicts: &[Outcome]) -> bool {
        match self {
            Charging::PerDescriptor => true,
            Charging::Nothing => false,
            Charging::Atomic => {
                !request_refused(hits.iter().zip(verdicts).map(|(h, v)| (h.role, v.admitted)))
            }
        }
    }
}

/// The answer on one hit, whoever gives it: an algorithm's arithmetic (before anything is
/// written), a backend, a quota lease or the over-limit cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub admitted: bool,
    /// Units left once this hit is recorded (0 when refused).
    pub remaining: u32,
    /// Admitted: until the limit is back to full. Refused: until a hit of the same cost would
    /// be admitted (the exact retry time).
    pub reset_after: Duration,
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum BackendError {
    #[error("backend timed out")]
    Timeout,
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    #[error("backend is full: {0}")]
    Full(String),
    #[error("backend circuit open: failing fast")]
    CircuitOpen,
    /// The caller's wait ran out while its request queued in this process, or the backend's
    /// own timeout passed while this process could not run: this process's delay, not the
    /// backend's.
    #[error("backend answer late: the request waited in turnstile")]
    Late,
    /// Too many requests already queued for the backend: this process is overloaded.
    #[error("backend overloaded: too many requests queued")]
    Overloaded,
}

impl BackendError {
    /// A short name for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            BackendError::Timeout => "backend_timeout",
            BackendError::Unavailable(_) => "backend_unavailable",
            BackendError::Full(_) => "backend_full",
            BackendError::CircuitOpen => "circuit_open",
            BackendError::Late => "backend_late",
            BackendError::Overloaded => "backend_overloaded",
        }
    }

    pub const KINDS: [&'static str; 6] = [
        "backend_timeout",
        "backend_unavailable",
        "backend_full",
        "circuit_open",
        "backend_late",
        "backend_overloaded",
    ];
}

/// Whether the request as a whole is refused, given each hit's role and admission: any
/// enforced hit refused, or quota hits present and all of them refused. The Lua batch
/// driver applies the same rule.
pub fn request_refused(verdicts: impl IntoIterator<Item = (Role, bool)>) -> bool {
    let (mut quota_seen, mut quota_all_refused) = (false, true);
    for (role, admitted) in verdicts {
        match role {
            Role::Enforce if !admitted => return true,
            Role::Quota => {
                quota_seen = true;
                quota_all_refused &= !admitted;
            }
            _ => {}
        }
    }
    quota_seen && quota_all_refused
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    #[default]
    Error,
    Allow,
    Deny,
    Local,
}

impl FailurePolicy {
    pub const ALL: [FailurePolicy; 4] = [
        FailurePolicy::Error,
        FailurePolicy::Allow,
        FailurePolicy::Deny,
        FailurePolicy::Local,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FailurePolicy::Error => "error",
            FailurePolicy::Allow => "allow",
            FailurePolicy::Deny => "deny",
            FailurePolicy::Local => "local",
        }
    }

    pub fn parse(name: &str) -> Option<FailurePolicy> {
        FailurePolicy::ALL.into_iter().find(|p| p.name() == name)
    }
}

impl fmt::Display for FailurePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Role::*;

    #[test]
    fn request_refusal_follows_roles() {
        assert!(!request_refused([]));
        assert!(!request_refused([(Enforce, true), (Shadow, false)]));
        assert!(request_refused([(Enforce, true), (Enforce, false)]));
        assert!(!request_refused([(Quota, false), (Quota, true)]));
        assert!(request_refused([(Quota, false), (Quota, false)]));
        assert!(request_refused([(Quota, true), (Enforce, false)]));
    }
}
