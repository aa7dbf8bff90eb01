//! Key layouts. turnstile's own puts a limit's whole identity in a Cluster hash tag, so all
//! its keys share a slot. The reference server's (`<prefix><domain>_<key>_<value>_..._<window
//! start>`, fixed windows only) is offered so that, during a rolling switch, turnstile and
//! the Go server count fixed windows on the same keys.

use crate::key::unescape;
use crate::limit::{Kind, Limit};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyLayout {
    #[default]
    Turnstile,
    /// Fixed windows on the reference's keys; other algorithms keep turnstile's.
    Reference,
}

impl KeyLayout {
    pub(super) const ALL: [KeyLayout; 2] = [KeyLayout::Turnstile, KeyLayout::Reference];

    /// The layout a limit of `kind` is kept in: the reference counts fixed windows only.
    pub(super) fn of(self, kind: Kind) -> KeyLayout {
        if kind == Kind::FixedWindow {
            self
        } else {
            KeyLayout::Turnstile
        }
    }

    fn reference(self, limit: &Limit) -> bool {
        self.of(limit.algorithm) == KeyLayout::Reference
    }

    /// The layout's name in Lua, given to each algorithm's twin (see `twins`).
    pub(super) fn lua_name(self) -> &'static str {
        match self {
            KeyLayout::Turnstile => "turnstile",
            KeyLayout::Reference => "reference",
        }
    }

    /// The Redis key a hit's script call is given (the script derives the rest from it).
    pub(super) fn key(self, prefix: &str, identity: &str, limit: &Limit) -> String {
        if self.reference(limit) {
            reference_key(prefix, identity)
        } else {
            // The whole identity is the hash tag, so every key the script derives from it
            // (`<key>:<window>`, `<key>:n`) lands in the same Cluster slot.
            format!("{prefix}{{{identity}}}")
        }
    }

    /// The script's name for the algorithm of `limit`.
    pub(super) fn script_algorithm(self, limit: &Limit) -> &'static str {
        self.script_name(limit.algorithm)
    }

    /// The script's name for `kind`'s twin in this layout: the one the batch script binds it
    /// to (see `twins`) and calls ask for.
    pub(super) fn script_name(self, kind: Kind) -> &'static str {
        match self.of(kind) {
            KeyLayout::Turnstile => kind.name(),
            // Only a fixed window is ever kept in the reference's layout.
            KeyLayout::Reference => "fixed_window_reference",
        }
    }
}

/// `<prefix><domain>_<key>_<value>_..._` from an identity `<domain>|<key>=<value>|...`
/// (see `crate::key`); the script appends the window start. The algorithm is not part of
/// the reference's key.
fn reference_key(prefix: &str, identity: &str) -> String {
    let mut parts = identity.split('|');
    let mut key = String::from(prefix);
    key.push_str(&unescape(parts.next().unwrap_or_default()));
    key.push('_');
    for part in parts {
        if let Some((k, v)) = part.split_once('=') {
            key.push_str(&unescape(k));
            key.push('_');
            key.push_str(&unescape(v));
            key.push('_');
        }
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::limit_key;
    use crate::limit::Unit;

    #[test]
    fn the_reference_layout_rebuilds_the_reference_key() {
        let limit = Limit::fixed(10, Unit::Minute);
        let identity = limit_key("dom", [("key2", "value2"), ("sub", "a=b%")], &limit, None);
        assert_eq!(
            KeyLayout::Reference.key("pre:", &identity, &limit),
            "pre:dom_key2_value2_sub_a=b%_"
        );
        assert_eq!(
            KeyLayout::Reference.script_algorithm(&limit),
            "fixed_window_reference"
        );
        let bucket = Limit {
            algorithm: Kind::TokenBucket,
            ..limit
        };
        assert_eq!(
            KeyLayout::Reference.key("", "d|k=v|token_bucket:60", &bucket),
            "{d|k=v|token_bucket:60}"
        );
    }
}
