//! The identity of one limit's state: which counter, log or bucket a hit lands on.
//!
//! Built from the request (domain and the descriptor's entries, as the reference builds its
//! cache keys), plus what makes two limits different state: the algorithm and the window (so
//! several limits on one descriptor never share state). The requests-per-unit figure is
//! deliberately left out, so a reload that only changes the number keeps the count, and a
//! request's `limit` override of the rule's unit counts on the rule's counter, as in the
//! reference. Separators are percent-encoded where they occur
//! in user data, so `a_b=c` and `a=b_c` can never share a counter (a reference quirk), and
//! so no brace can cut a Redis Cluster hash tag short.

use crate::decision::limit::Limit;

/// The characters a key encodes, and their codes. `%` comes last so that decoding in this
/// order restores it only after every other code is read.
const ESCAPES: [(char, &str); 5] = [
    ('|', "%7C"),
    ('=', "%3D"),
    ('{', "%7B"),
    ('}', "%7D"),
    ('%', "%25"),
];

/// Append `text` with the key's separators (and braces) percent-encoded. The runs between
/// them are copied whole (every key is built anew on each call, and most values have none);
/// the separators are ASCII, so a byte of one is never inside a longer character.
fn push_escaped(out: &mut String, text: &str) {
    let mut copied = 0;
    for (at, byte) in text.bytes().enumerate() {
        if let Some((_, code)) = ESCAPES.iter().find(|(plain, _)| *plain as u8 == byte) {
            out.push_str(&text[copied..at]);
            out.push_str(code);
            copied = at + 1;
        }
    }
    out.push_str(&text[copied..]);
}

/// A key's part as it was before `push_escaped`.
pub fn unescape(text: &str) -> String {
    ESCAPES.iter().fold(text.to_owned(), |text, (plain, code)| {
        text.replace(code, &plain.to_string())
    })
}

/// The shard of a limit split over several sub-limits (`shards`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard(pub u32);

/// `<domain>|<key>=<value>|...|<algorithm>:<window seconds>[|#<shard>]`.
pub fn limit_key<'a>(
    domain: &str,
    entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    limit: &Limit,
    shard: Option<Shard>,
) -> String {
    let mut key = String::with_capacity(64);
    push_escaped(&mut key, domain);
    for (k, v) in entries {
        key.push('|');
        push_escaped(&mut key, k);
        key.push('=');
        push_escaped(&mut key, v);
    }
    let mut digits = itoa::Buffer::new();
    key.push('|');
    key.push_str(limit.algorithm.name());
    key.push(':');
    key.push_str(digits.format(limit.window));
    if let Some(Shard(shard)) = shard {
        key.push_str("|#");
        key.push_str(digits.format(shard));
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::limit::{Algorithm, Unit};

    fn with(algorithm: Algorithm, unit: Unit) -> Limit {
        Limit {
            algorithm,
            ..Limit::fixed(10, unit)
        }
    }

    #[test]
    fn separators_in_data_cannot_collide_or_open_a_hash_tag() {
        let l = with(Algorithm::FixedWindow, Unit::Minute);
        let a = limit_key("d", [("a_b", "c")], &l, None);
        let b = limit_key("d", [("a", "b_c")], &l, None);
        assert_ne!(a, b);
        let c = limit_key("d", [("a", "b|x=y")], &l, None);
        let d = limit_key("d", [("a", "b"), ("x", "y")], &l, None);
        assert_ne!(c, d);
        let braces = limit_key(
            "d{",
            [("}", "%")],
            &with(Algorithm::TokenBucket, Unit::Second),
            None,
        );
        assert_eq!(braces, "d%7B|%7D=%25|token_bucket:1");
        for text in ["a|b=c", "{x}", "100%", "%7C", "%|%", "é|ü=ß", ""] {
            let mut escaped = String::new();
            push_escaped(&mut escaped, text);
            assert_eq!(unescape(&escaped), text);
        }
    }

    #[test]
    fn algorithms_and_windows_are_separate_state_but_numbers_are_not() {
        let entries = [("user", "alice")];
        let minute = with(Algorithm::FixedWindow, Unit::Minute);
        let plain = limit_key("d", entries, &minute, None);
        assert_eq!(plain, "d|user=alice|fixed_window:60");
        assert_ne!(
            plain,
            limit_key(
                "d",
                entries,
                &with(Algorithm::TokenBucket, Unit::Minute),
                None,
            )
        );
        assert_ne!(
            plain,
            limit_key(
                "d",
                entries,
                &with(Algorithm::FixedWindow, Unit::Hour),
                None,
            )
        );
        let sharded = limit_key("d", entries, &minute, Some(Shard(3)));
        assert_eq!(sharded, "d|user=alice|fixed_window:60|#3");
        let raised = Limit::fixed(99, Unit::Minute);
        assert_eq!(plain, limit_key("d", entries, &raised, None));
    }
}
