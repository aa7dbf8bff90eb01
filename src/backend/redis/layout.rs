//! Key layouts. turnstile's own puts a limit's whole identity in a Cluster hash tag, so all
//! its keys share a slot. The reference server's (`<prefix><domain>_<key>_<value>_..._<window
//! start>`, fixed windows only) is offered so that, during a rolling switch, turnstile and
//! the Go server count fixed windows on the same keys.
//!
//! An identity holds the request's descriptor values, up to the request bounds (4 KiB by
//! default): a longer one than `MAX_TAG_BYTES` is named in turnstile's layout by its head and
//! a digest of the whole (`hash_tag`), so what Redis keeps, hashes and copies per limit does
//! not grow with what a client sends.

use std::borrow::Cow;

use crate::decision::key::unescape;
use crate::decision::limit::{Algorithm, Limit};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyLayout {
    #[default]
    Turnstile,
    /// Fixed windows on the reference's keys; other algorithms keep turnstile's.
    Reference,
}

impl KeyLayout {
    pub(super) const ALL: [KeyLayout; 2] = [KeyLayout::Turnstile, KeyLayout::Reference];

    /// The layout a limit of `algorithm` is kept in: the reference counts fixed windows only.
    pub(super) fn of(self, algorithm: Algorithm) -> KeyLayout {
        if algorithm == Algorithm::FixedWindow {
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
            tagged(prefix, identity)
        }
    }

    /// The script's name for the algorithm of `limit`.
    pub(super) fn script_algorithm(self, limit: &Limit) -> &'static str {
        self.script_name(limit.algorithm)
    }

    /// The script's name for `algorithm`'s twin in this layout: the one the batch script binds it
    /// to (see `twins`) and calls ask for.
    pub(super) fn script_name(self, algorithm: Algorithm) -> &'static str {
        match self.of(algorithm) {
            KeyLayout::Turnstile => algorithm.name(),
            // Only a fixed window is ever kept in the reference's layout.
            KeyLayout::Reference => "fixed_window_reference",
        }
    }
}

/// `<prefix>{<tag>}`: the key of the limit whose identity is `identity`. The tag stands for
/// the whole identity, so every key derived from it (the script's `<key>:<window>` and
/// `<key>:n`, another module's `<key><suffix>`) lands in the limit's Cluster slot.
pub(super) fn tagged(prefix: &str, identity: &str) -> String {
    let tag = hash_tag(identity);
    let mut key = String::with_capacity(prefix.len() + tag.len() + 2);
    key.push_str(prefix);
    key.push('{');
    key.push_str(&tag);
    key.push('}');
    key
}

/// Longest identity that is its own hash tag.
const MAX_TAG_BYTES: usize = 128;
/// A SHA-1 digest in hexadecimal.
const DIGEST_CHARS: usize = 40;

/// The hash tag of the limit whose identity is `identity`: the identity itself, or, past
/// `MAX_TAG_BYTES`, its head, `{` and the SHA-1 of the whole (a stable digest: every instance
/// and version names the limit alike). An identity never holds a brace
/// (`crate::decision::key` escapes them), so no identity's tag is another's digested one; a
/// collision of SHA-1 would join only two identities both made for it, never one chosen in
/// advance.
fn hash_tag(identity: &str) -> Cow<'_, str> {
    if identity.len() <= MAX_TAG_BYTES {
        return Cow::Borrowed(identity);
    }
    let head = &identity[..identity.floor_char_boundary(MAX_TAG_BYTES - DIGEST_CHARS - 1)];
    let digest = sha1_smol::Sha1::from(identity).digest().to_string();
    Cow::Owned(format!("{head}{{{digest}"))
}

/// `<prefix><domain>_<key>_<value>_..._` from an identity `<domain>|<key>=<value>|...`
/// (see `crate::decision::key`); the script appends the window start. The algorithm is not part of
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
    use crate::decision::key::limit_key;
    use crate::decision::limit::Unit;

    /// Short identities are their own tag; long ones (here a value of 4 000 bytes, ending in
    /// a character of 2 bytes at the cut) are named by a head and a digest, bounded, distinct
    /// for identities that differ only past the head, alike for the same identity, and never
    /// equal to a short identity written to look like one (it cannot hold a brace).
    #[test]
    fn long_identities_are_named_by_their_head_and_a_digest() {
        let limit = Limit::fixed(10, Unit::Minute);
        let identity = |value: &str| limit_key("dom", [("user", value)], &limit, None);
        let short = identity("alice");
        assert_eq!(hash_tag(&short), short.as_str());
        let long =
            |last: char| identity(&format!("{}é{}{last}", "x".repeat(80), "y".repeat(4_000)));
        let (a, b) = (long('a'), long('b'));
        let (tag_a, tag_b) = (hash_tag(&a), hash_tag(&b));
        assert!(tag_a.len() <= MAX_TAG_BYTES, "{tag_a}");
        assert!(tag_a.starts_with("dom|user=xxxx"), "{tag_a}");
        assert_ne!(tag_a, tag_b);
        assert_eq!(tag_a, hash_tag(&a.clone()));
        let lookalike = identity(&tag_a["dom|user=".len()..]);
        assert_ne!(hash_tag(&lookalike), tag_a);
        assert_eq!(
            KeyLayout::Turnstile.key("pre:", &a, &limit),
            format!("pre:{{{tag_a}}}")
        );
    }

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
            algorithm: Algorithm::TokenBucket,
            ..limit
        };
        assert_eq!(
            KeyLayout::Reference.key("", "d|k=v|token_bucket:60", &bucket),
            "{d|k=v|token_bucket:60}"
        );
    }
}
