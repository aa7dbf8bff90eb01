//! A marked YAML tree.
//!
//! yaml-rust2's own `Yaml` value drops source positions, and every config error has to point at
//! a line and column, so the loader builds this small tree from the parser's marked events.
//! Scalars keep their text and whether they were plain: only plain scalars are read as numbers,
//! booleans or null, the way YAML 1.1 (the reference's yaml.v2) resolves them.

use std::collections::HashMap;

use yaml_rust2::parser::{Event, MarkedEventReceiver, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

use super::ConfigError;

/// A 1-based line and column in the source text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Pos {
    pub line: usize,
    pub column: usize,
}

impl Pos {
    /// The start of a file: where file-level errors (unreadable, empty) point.
    pub const START: Pos = Pos { line: 1, column: 1 };

    fn of(mark: Marker) -> Pos {
        // yaml-rust2 counts lines from 1 but columns from 0.
        Pos {
            line: mark.line(),
            column: mark.col() + 1,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum NodeKind {
    /// `plain` is false for quoted, block and explicitly tagged scalars, which are always text.
    Scalar {
        text: String,
        plain: bool,
    },
    Seq(Vec<Node>),
    Map(Vec<(Node, Node)>),
    Null,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub kind: NodeKind,
    pub pos: Pos,
}

impl Node {
    /// Short rendering for error messages: a scalar's text, or what kind of collection it is.
    pub fn describe(&self) -> String {
        match &self.kind {
            NodeKind::Scalar { text, .. } => text.clone(),
            NodeKind::Seq(_) => "a list".to_owned(),
            NodeKind::Map(_) => "a map".to_owned(),
            NodeKind::Null => "null".to_owned(),
        }
    }
}

/// Deepest nesting of lists and maps a config file may have. The reference's files rarely
/// go past a dozen levels (a descriptor level is two: its list and its map); the bound keeps
/// every recursive walk of the tree (validation, matching, dropping it) far from the end of
/// a 2 MiB worker stack, where a reload runs.
pub const MAX_DEPTH: usize = 64;

/// Every document in `text`, in order. A file may hold several `---` documents.
pub fn parse(file: &str, text: &str) -> Result<Vec<Node>, ConfigError> {
    let error = |marker: Marker, message: String| ConfigError::at(file, Pos::of(marker), message);
    // Editors on Windows start files with a byte order mark; YAML readers skip it.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut builder = TreeBuilder::default();
    // Events are pulled one at a time rather than through `Parser::load`, which recurses once
    // per nesting level: a deep enough file would overflow the stack before any check ran.
    let mut parser = Parser::new_from_str(text);
    loop {
        let (event, mark) = parser.next_token().map_err(|e| {
            error(
                *e.marker(),
                format!("error loading config file: {}", e.info()),
            )
        })?;
        let opens = matches!(event, Event::SequenceStart(..) | Event::MappingStart(..));
        if opens && builder.open.len() >= MAX_DEPTH {
            return Err(error(
                mark,
                format!("config nested deeper than {MAX_DEPTH} levels of lists and maps"),
            ));
        }
        if event == Event::StreamEnd {
            break;
        }
        builder.on_event(event, mark);
    }
    // A key given twice would silently lose one of its values (the reference's yaml.v2
    // refuses it too).
    if let Some((pos, key, first)) = builder.first_duplicate {
        return Err(ConfigError::at(
            file,
            pos,
            format!(
                "key '{key}' already set in this map (at line {}, column {})",
                first.line, first.column
            ),
        ));
    }
    // Expanding aliases would let a tiny file grow without bound; rules never need them.
    if let Some(pos) = builder.first_alias {
        return Err(ConfigError::at(
            file,
            pos,
            "YAML aliases (*name) are not supported in config files",
        ));
    }
    Ok(builder.documents)
}

/// YAML 1.1 booleans, in any letter case.
pub fn resolve_bool(text: &str) -> Option<bool> {
    let is = |words: &[&str]| words.iter().any(|w| w.eq_ignore_ascii_case(text));
    if is(&["true", "yes", "on", "y"]) {
        Some(true)
    } else if is(&["false", "no", "off", "n"]) {
        Some(false)
    } else {
        None
    }
}

/// A YAML 1.1 integer as yaml.v2 reads it: `_` separators ignored, an optional sign, and the
/// prefixes `0x`, `0o`, `0b`, or a bare leading `0` for octal (so `010` is 8).
pub fn resolve_int(text: &str) -> Option<i128> {
    let cleaned: String = text.chars().filter(|&c| c != '_').collect();
    let (negative, unsigned) = match cleaned.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, cleaned.strip_prefix('+').unwrap_or(&cleaned)),
    };
    let lower = unsigned.to_ascii_lowercase();
    let (radix, digits) = if let Some(rest) = lower.strip_prefix("0x") {
        (16, rest)
    } else if let Some(rest) = lower.strip_prefix("0o") {
        (8, rest)
    } else if let Some(rest) = lower.strip_prefix("0b") {
        (2, rest)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, &lower[1..])
    } else {
        (10, lower.as_str())
    };
    // from_str_radix alone would also take a sign after the prefix.
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let magnitude = i128::from(u64::from_str_radix(digits, radix).ok()?);
    Some(if negative { -magnitude } else { magnitude })
}

/// A YAML 1.1 float (`1.5`, `-2e3`, `.5`, `.inf`, `.nan`), as yaml.v2 resolves plain scalars.
pub fn is_float(text: &str) -> bool {
    let cleaned: String = text.chars().filter(|&c| c != '_').collect();
    let unsigned = cleaned
        .strip_prefix(['-', '+'])
        .unwrap_or(&cleaned)
        .to_ascii_lowercase();
    if unsigned == ".inf" || cleaned.eq_ignore_ascii_case(".nan") {
        return true;
    }
    let (mantissa, exponent) = match unsigned.split_once('e') {
        Some((m, e)) => (m, Some(e.strip_prefix(['-', '+']).unwrap_or(e))),
        None => (unsigned.as_str(), None),
    };
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let mantissa_ok = match mantissa.split_once('.') {
        Some(("", fraction)) => all_digits(fraction),
        Some((whole, fraction)) => {
            all_digits(whole) && (fraction.is_empty() || all_digits(fraction))
        }
        None => all_digits(mantissa),
    };
    mantissa_ok && exponent.is_none_or(all_digits)
}

/// Plain scalars YAML 1.1 reads as null.
fn is_null(text: &str) -> bool {
    matches!(text, "" | "~" | "null" | "Null" | "NULL")
}

/// Collects parser events into one tree per document.
#[derive(Default)]
struct TreeBuilder {
    documents: Vec<Node>,
    open: Vec<Open>,
    first_alias: Option<Pos>,
    /// The first key met twice in one map: where, which, and where it was first.
    first_duplicate: Option<(Pos, String, Pos)>,
}

/// A collection whose end event has not arrived yet.
struct Open {
    pos: Pos,
    kind: OpenKind,
}

enum OpenKind {
    Seq(Vec<Node>),
    /// Entries so far, a key still waiting for its value, and where each scalar key is.
    Map(Vec<(Node, Node)>, Option<Node>, HashMap<String, Pos>),
}

impl TreeBuilder {
    fn push(&mut self, node: Node) {
        match self.open.last_mut() {
            None => self.documents.push(node),
            Some(Open {
                kind: OpenKind::Seq(items),
                ..
            }) => items.push(node),
            Some(Open {
                kind: OpenKind::Map(entries, pending, keys),
                ..
            }) => match pending.take() {
                Some(key) => entries.push((key, node)),
                None => {
                    if let NodeKind::Scalar { text, .. } = &node.kind
                        && let Some(first) = keys.insert(text.clone(), node.pos)
                    {
                        self.first_duplicate
                            .get_or_insert((node.pos, text.clone(), first));
                    }
                    *pending = Some(node);
                }
            },
        }
    }
}

impl MarkedEventReceiver for TreeBuilder {
    fn on_event(&mut self, event: Event, mark: Marker) {
        let pos = Pos::of(mark);
        match event {
            Event::Scalar(text, style, _anchor, tag) => {
                let plain = style == TScalarStyle::Plain && tag.is_none();
                let kind = if plain && is_null(&text) {
                    NodeKind::Null
                } else {
                    NodeKind::Scalar { text, plain }
                };
                self.push(Node { kind, pos });
            }
            Event::SequenceStart(..) => self.open.push(Open {
                pos,
                kind: OpenKind::Seq(Vec::new()),
            }),
            Event::MappingStart(..) => self.open.push(Open {
                pos,
                kind: OpenKind::Map(Vec::new(), None, HashMap::new()),
            }),
            Event::SequenceEnd | Event::MappingEnd => {
                if let Some(open) = self.open.pop() {
                    let (kind, pos) = match open.kind {
                        OpenKind::Seq(items) => (NodeKind::Seq(items), open.pos),
                        // A block mapping's start event is marked at its first `:`, so the
                        // first key (when earlier, as it is outside flow style) marks it better.
                        OpenKind::Map(entries, ..) => {
                            let pos = entries.first().map_or(open.pos, |(key, _)| key.pos);
                            (NodeKind::Map(entries), open.pos.min(pos))
                        }
                    };
                    self.push(Node { kind, pos });
                }
            }
            Event::Alias(_) => {
                self.first_alias.get_or_insert(pos);
                // A placeholder keeps the tree's shape consistent; parse() fails anyway.
                self.push(Node {
                    kind: NodeKind::Null,
                    pos,
                });
            }
            Event::Nothing
            | Event::StreamStart
            | Event::StreamEnd
            | Event::DocumentStart
            | Event::DocumentEnd => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scalar(text: &str, plain: bool, line: usize, column: usize) -> Node {
        Node {
            kind: NodeKind::Scalar {
                text: text.to_owned(),
                plain,
            },
            pos: Pos { line, column },
        }
    }

    #[test]
    fn builds_a_marked_tree() {
        let docs = parse("f.yaml", "domain: d\nlist:\n  - a: 'x'\n    b: ~\n").unwrap();
        assert_eq!(docs.len(), 1);
        let NodeKind::Map(entries) = &docs[0].kind else {
            panic!("root is not a map: {:?}", docs[0]);
        };
        assert_eq!(docs[0].pos, Pos { line: 1, column: 1 });
        assert_eq!(entries[0].0, scalar("domain", true, 1, 1));
        assert_eq!(entries[0].1, scalar("d", true, 1, 9));
        let NodeKind::Seq(items) = &entries[1].1.kind else {
            panic!("not a list: {:?}", entries[1].1);
        };
        assert_eq!(items[0].pos, Pos { line: 3, column: 5 });
        let NodeKind::Map(item) = &items[0].kind else {
            panic!("not a map: {:?}", items[0]);
        };
        assert_eq!(item[0].1, scalar("x", false, 3, 8));
        assert_eq!(item[1].1.kind, NodeKind::Null);
        assert_eq!(item[1].1.pos.line, 4);
    }

    #[test]
    fn every_document_is_returned() {
        let docs = parse("f.yaml", "domain: a\n---\ndomain: b\n---\n").unwrap();
        assert_eq!(docs.len(), 3);
        assert_eq!(docs[1].pos.line, 3);
        assert_eq!(docs[2].kind, NodeKind::Null);
        assert!(parse("f.yaml", "").unwrap().is_empty());
        assert!(parse("f.yaml", "# only a comment\n").unwrap().is_empty());
    }

    #[test]
    fn syntax_errors_carry_the_scanner_position() {
        let err = parse("bad.yaml", "domain: x\nkey: '''\n").unwrap_err();
        assert_eq!(err.file, "bad.yaml");
        assert_eq!((err.line, err.column), (2, 6));
        assert_eq!(
            err.message,
            "error loading config file: while scanning a quoted scalar, found unexpected end of stream"
        );
        let err = parse("bad.yaml", "a: b\n c: d\n").unwrap_err();
        assert_eq!((err.line, err.column), (2, 3));
        assert!(err.message.starts_with("error loading config file: "));
    }

    #[test]
    fn aliases_are_rejected_at_their_position() {
        let err = parse("f.yaml", "a: &x 1\nb: *x\n").unwrap_err();
        assert_eq!((err.line, err.column), (2, 4));
        assert_eq!(
            err.message,
            "YAML aliases (*name) are not supported in config files"
        );
    }

    #[test]
    fn a_key_given_twice_in_one_map_is_refused() {
        // Where the second key is (line, column), and the message.
        type Refused<'a> = Option<((usize, usize), &'a str)>;
        // (text, the error)
        let rows: [(&str, Refused<'_>); 4] = [
            (
                "domain: a\ndomain: b\n",
                Some((
                    (2, 1),
                    "key 'domain' already set in this map (at line 1, column 1)",
                )),
            ),
            (
                "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, unit: day}\n",
                Some((
                    (4, 30),
                    "key 'unit' already set in this map (at line 4, column 18)",
                )),
            ),
            // The same key in two maps of a list is two descriptors, not a duplicate.
            ("descriptors:\n  - key: a\n  - key: b\n", None),
            // Quoting does not make it another key.
            (
                "a: 1\n'a': 2\n",
                Some((
                    (2, 1),
                    "key 'a' already set in this map (at line 1, column 1)",
                )),
            ),
        ];
        for (text, expected) in rows {
            let got = parse("dup.yaml", text)
                .err()
                .map(|e| ((e.line, e.column), e.message));
            let expected = expected.map(|(at, message)| (at, message.to_owned()));
            assert_eq!(got, expected, "{text}");
        }
    }

    #[test]
    fn nesting_is_bounded_before_the_tree_is_built() {
        // Block style nests by indentation, flow style by brackets: each is refused at the
        // first collection past the bound, however deep the file goes (the parser's own
        // recursive loader would overflow the stack on these).
        let block = |depth: usize| {
            (0..depth)
                .map(|i| format!("{}- k{i}:\n", "  ".repeat(2 * i)))
                .collect::<String>()
        };
        let flow = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        let too_deep = format!("config nested deeper than {MAX_DEPTH} levels of lists and maps");
        // The scanner reads flow brackets ahead of the parser and has its own bound (255).
        let scanner_bound = "error loading config file: recursion limit exceeded";
        for (text, error) in [
            (block(MAX_DEPTH / 2), None),
            (flow(MAX_DEPTH), None),
            (block(MAX_DEPTH / 2 + 1), Some(too_deep.as_str())),
            (flow(MAX_DEPTH + 1), Some(&too_deep)),
            (block(2_000), Some(&too_deep)),
            (flow(2_000), Some(scanner_bound)),
        ] {
            let result = std::thread::Builder::new()
                .stack_size(256 * 1024)
                .spawn(move || parse("deep.yaml", &text).map(|_| ()))
                .unwrap()
                .join()
                .expect("parsing must not overflow a small stack");
            assert_eq!(result.map_err(|e| e.message).err().as_deref(), error);
        }
        let e = parse("deep.yaml", &flow(100)).unwrap_err();
        assert_eq!((e.line, e.column), (1, MAX_DEPTH + 1));
    }

    #[test]
    fn a_byte_order_mark_is_skipped() {
        let docs = parse("bom.yaml", "\u{feff}domain: d\n").unwrap();
        let NodeKind::Map(entries) = &docs[0].kind else {
            panic!("root is not a map: {:?}", docs[0]);
        };
        assert_eq!(entries[0].0, scalar("domain", true, 1, 1));
    }

    #[test]
    fn tagged_and_quoted_scalars_are_not_plain() {
        let docs = parse("f.yaml", "- !!str 5\n- \"6\"\n- 7\n- |\n  8\n").unwrap();
        let NodeKind::Seq(items) = &docs[0].kind else {
            panic!("not a list");
        };
        let plain: Vec<bool> = items
            .iter()
            .map(|n| matches!(n.kind, NodeKind::Scalar { plain: true, .. }))
            .collect();
        assert_eq!(plain, [false, false, true, false]);
    }

    #[test]
    fn yaml_1_1_scalars() {
        for yes in ["true", "TRUE", "True", "yes", "On", "y"] {
            assert_eq!(resolve_bool(yes), Some(true), "{yes}");
        }
        for no in ["false", "No", "OFF", "n"] {
            assert_eq!(resolve_bool(no), Some(false), "{no}");
        }
        assert_eq!(resolve_bool("maybe"), None);

        assert_eq!(resolve_int("42"), Some(42));
        assert_eq!(resolve_int("+1_000"), Some(1000));
        assert_eq!(resolve_int("-7"), Some(-7));
        assert_eq!(resolve_int("010"), Some(8));
        assert_eq!(resolve_int("0x1F"), Some(31));
        assert_eq!(resolve_int("0b101"), Some(5));
        assert_eq!(resolve_int("0o17"), Some(15));
        assert_eq!(resolve_int("0"), Some(0));
        assert_eq!(resolve_int("0x-1"), None);
        assert_eq!(resolve_int("09"), None);
        assert_eq!(resolve_int("1.5"), None);
        assert_eq!(resolve_int("ten"), None);

        for float in [
            "0.25", "1.", ".5", "-2e3", "1.5E+2", ".inf", "-.Inf", ".NaN",
        ] {
            assert!(is_float(float), "{float}");
        }
        for not_float in ["abc", "1.2.3", "e5", ".", "1e", "inf"] {
            assert!(!is_float(not_float), "{not_float}");
        }
    }
}
