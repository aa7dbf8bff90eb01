//! The identity of one limit's state: which counter, log or bucket a hit lands on.
//!
//! Built from the request (domain and the descriptor's entries, as the reference builds its
//! cache keys), plus what makes two limits different state: a request-supplied override and
//! the algorithm. The requests-per-unit figure is deliberately left out, so a reload that
//! only changes the number keeps the count. Separators are percent-encoded where they occur
//! in user data, so `a_b=c` and `a=b_c` can never share a counter (a reference quirk), and
//! so no brace can cut a Redis Cluster hash tag short.

use std::fmt::Write;

use crate::limit::{Algorithm, Unit};

/// Append `text` with the key's separators (and braces) percent-encoded.
fn push_escaped(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '%' => out.push_str("%25"),
            '|' => out.push_str("%7C"),
            '=' => out.push_str("%3D"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            _ => out.push(c),
        }
    }
}

/// `<domain>|<key>=<value>|...[|@<override unit>]|<algorithm>`.
pub fn limit_key<'a>(
    domain: &str,
    entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    override_unit: Option<Unit>,
    algorithm: Algorithm,
) -> String {
    let mut key = String::with_capacity(64);
    push_escaped(&mut key, domain);
    for (k, v) in entries {
        key.push('|');
        push_escaped(&mut key, k);
        key.push('=');
        push_escaped(&mut key, v);
    }
    if let Some(unit) = override_unit {
        let _ = write!(key, "|@{}", unit.name());
    }
    key.push('|');
    key.push_str(algorithm.name());
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn separators_in_data_cannot_collide_or_open_a_hash_tag() {
        let a = limit_key("d", [("a_b", "c")], None, Algorithm::FixedWindow);
        let b = limit_key("d", [("a", "b_c")], None, Algorithm::FixedWindow);
        assert_ne!(a, b);
        let c = limit_key("d", [("a", "b|x=y")], None, Algorithm::FixedWindow);
        let d = limit_key("d", [("a", "b"), ("x", "y")], None, Algorithm::FixedWindow);
        assert_ne!(c, d);
        let braces = limit_key("d{", [("}", "%")], None, Algorithm::TokenBucket);
        assert_eq!(braces, "d%7B|%7D=%25|token_bucket");
    }

    #[test]
    fn overrides_and_algorithms_are_separate_state() {
        let entries = [("user", "alice")];
        let plain = limit_key("d", entries, None, Algorithm::FixedWindow);
        let overridden = limit_key("d", entries, Some(Unit::Minute), Algorithm::FixedWindow);
        let bucket = limit_key("d", entries, None, Algorithm::TokenBucket);
        assert_eq!(plain, "d|user=alice|fixed_window");
        assert_eq!(overridden, "d|user=alice|@MINUTE|fixed_window");
        assert_ne!(plain, bucket);
    }
}
