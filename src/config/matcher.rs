//! The compiled, validated rules the service consults on every request.
//!
//! Children are stored by key, then by value, so a lookup borrows the request's strings and
//! builds nothing; the walk copies the reference's order (exact value, then wildcards in config
//! order, then the key-only default) and its lack of backtracking.

use std::collections::{BTreeMap, HashMap};

use crate::decision::FailurePolicy;
use crate::decision::limit::Limit;

/// Every loaded domain, and what they were loaded from; the default is no rules at all.
#[derive(Debug, Default)]
pub struct RuleSet {
    domains: BTreeMap<String, DomainRules>,
    version: String,
    files: Vec<String>,
}

impl RuleSet {
    pub(super) fn new(
        domains: BTreeMap<String, DomainRules>,
        version: String,
        files: Vec<String>,
    ) -> RuleSet {
        RuleSet {
            domains,
            version,
            files,
        }
    }

    pub fn domain(&self, name: &str) -> Option<&DomainRules> {
        self.domains.get(name)
    }

    /// Sorted by name.
    pub fn domains(&self) -> impl Iterator<Item = &DomainRules> {
        self.domains.values()
    }

    /// Hex SHA-1 over the loaded files' names and bytes: equal for loads of the same content.
    /// For rules from xDS, the response's version.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The files loaded, in load order.
    pub fn files(&self) -> &[String] {
        &self.files
    }

    /// The `/rlconfig` text: one sorted line per rule, each ending in a newline.
    pub fn describe(&self) -> String {
        let mut lines: Vec<String> = self
            .domains
            .values()
            .flat_map(|d| &d.rules)
            .map(Rule::describe)
            .collect();
        lines.sort();
        lines.into_iter().map(|line| line + "\n").collect()
    }
}

/// One domain's rule tree.
#[derive(Debug)]
pub struct DomainRules {
    name: String,
    root: Level,
    /// Every rule of the tree; tree nodes refer to them by index.
    rules: Vec<Rule>,
    on_backend_error: Option<FailurePolicy>,
}

impl DomainRules {
    pub(super) fn new(
        name: String,
        root: Level,
        rules: Vec<Rule>,
        on_backend_error: Option<FailurePolicy>,
    ) -> DomainRules {
        DomainRules {
            name,
            root,
            rules,
            on_backend_error,
        }
    }

    /// This domain's failure policy, when its rules set one.
    pub fn on_backend_error(&self) -> Option<FailurePolicy> {
        self.on_backend_error
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Limited and unlimited rules.
    pub fn rule_count(&self) -> usize {
        self.rules.len()
    }

    /// Walk one request descriptor's (key, value) entries as the reference does. A rule applies
    /// only when its node is reached at the last entry; a request longer than the config path,
    /// or one ending on a node without `rate_limit`, gets none.
    pub fn lookup<'a>(
        &self,
        entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Option<&Rule> {
        self.walk(entries).ok()
    }

    /// The same walk as `lookup`, saying where and why it found no rule (for `explain`).
    pub fn walk<'a>(
        &self,
        entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<&Rule, Miss> {
        let mut level = &self.root;
        let mut entries = entries.into_iter().enumerate().peekable();
        while let Some((entry, (key, value))) = entries.next() {
            let branches = match level.keys.get(key) {
                Some(branches) => branches,
                None if entry > 0 && level.keys.is_empty() => {
                    return Err(Miss::PastTheEnd { entry });
                }
                None => return Err(Miss::NoKey { entry }),
            };
            let step = branches.find(value).ok_or(Miss::NoValue { entry })?;
            if entries.peek().is_none() {
                return step.rule.map(|i| &self.rules[i]).ok_or(Miss::NoLimitHere);
            }
            level = &step.children;
        }
        Err(Miss::Empty)
    }

    /// Walk an unordered set of (key, value) entries (an RLQS bucket id, whose keys carry no
    /// order): the rule tree supplies the order. Each step takes a remaining entry whose key
    /// the level knows (in the given order) and matches its value as `lookup` does; a path
    /// that cannot use every entry on a node with a rule is abandoned for the next. Returns
    /// the rule and the entries in the rule's order.
    pub fn lookup_set<'a>(
        &self,
        entries: &[(&'a str, &'a str)],
    ) -> Option<(&Rule, Vec<(&'a str, &'a str)>)> {
        let mut path = Vec::with_capacity(entries.len());
        let mut used = vec![false; entries.len()];
        let rule = self.walk_set(&self.root, entries, &mut used, &mut path)?;
        Some((rule, path))
    }

    fn walk_set<'a>(
        &self,
        level: &Level,
        entries: &[(&'a str, &'a str)],
        used: &mut [bool],
        path: &mut Vec<(&'a str, &'a str)>,
    ) -> Option<&Rule> {
        for (i, &(key, value)) in entries.iter().enumerate() {
            if used[i] {
                continue;
            }
            let Some(step) = level.keys.get(key).and_then(|b| b.find(value)) else {
                continue;
            };
            used[i] = true;
            path.push((key, value));
            let found = if path.len() == entries.len() {
                step.rule.map(|r| &self.rules[r])
            } else {
                self.walk_set(&step.children, entries, used, path)
            };
            if found.is_some() {
                return found;
            }
            used[i] = false;
            path.pop();
        }
        None
    }
}

/// Why a descriptor matched no rule; `entry` is the 0-based index of the entry the walk
/// stopped at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Miss {
    /// The descriptor has no entries.
    Empty,
    /// No rule at this depth has the entry's key.
    NoKey { entry: usize },
    /// Rules have the key, but no value of theirs (exact, wildcard or key-only) matches.
    NoValue { entry: usize },
    /// The rules' path ended before this entry: the descriptor is longer than any rule.
    PastTheEnd { entry: usize },
    /// Every entry matched, but the node reached has no `rate_limit` (only deeper ones do).
    NoLimitHere,
}

/// A configured limit, or an explicit "unlimited", at one node of the tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    /// The YAML `name`, the target of other rules' `replaces`.
    pub name: Option<String>,
    /// The stats key: the config path, e.g. `domain.key1_value1.subkey1`; wildcard nodes keep
    /// their pattern.
    pub full_key: String,
    /// `None` when unlimited.
    pub limit: Option<Limit>,
    /// Further limits on the same descriptor (a `rate_limit` list), all enforced at once.
    pub also: Vec<Limit>,
    /// The rule's `metadata`, returned in the reference's response metadata when it passes.
    pub metadata: Option<serde_json::Value>,
    /// Independent sub-limits the limit is split over (1: not split); each request lands on
    /// one at random, with its share of the limit.
    pub shards: u32,
    /// Per level of the rule's path, the wildcard pattern whose matches share one counter
    /// (`share_threshold`), used in place of the request's value in the counter's key.
    pub shared: Vec<Option<String>>,
    pub shadow_mode: bool,
    pub quota_mode: bool,
    pub detailed_metric: bool,
    pub replaces: Vec<String>,
}

impl Rule {
    fn describe(&self) -> String {
        let Some(limit) = &self.limit else {
            return format!("{}: unlimited", self.full_key);
        };
        let mut line = format!(
            "{}: unit={} requests_per_unit={}, shadow_mode: {}, quota_mode: {}, algorithm: {}",
            self.full_key,
            limit.unit,
            limit.requests_per_unit,
            self.shadow_mode,
            self.quota_mode,
            limit.algorithm
        );
        if limit.algorithm.takes_burst() {
            line += &format!(", burst: {}", limit.burst);
        }
        line
    }
}

/// The children of one node (or of the domain root).
#[derive(Debug, Default)]
pub(super) struct Level {
    keys: HashMap<String, Branches>,
}

impl Level {
    /// `value` is `None` for the key-only default node; one containing `*` is a wildcard.
    /// Duplicates are rejected by validation before they get here.
    pub(super) fn insert(&mut self, key: &str, value: Option<&str>, step: Step) {
        let branches = self.keys.entry(key.to_owned()).or_default();
        match value {
            None => branches.default = Some(step),
            Some(pattern) if pattern.contains('*') => {
                branches.wildcards.push((Pattern::new(pattern), step));
            }
            Some(value) => {
                branches.exact.insert(value.to_owned(), step);
            }
        }
    }
}

/// The nodes of one level that share a key.
#[derive(Debug, Default)]
struct Branches {
    exact: HashMap<String, Step>,
    /// In config order: the first match wins.
    wildcards: Vec<(Pattern, Step)>,
    default: Option<Step>,
}

impl Branches {
    fn find(&self, value: &str) -> Option<&Step> {
        self.exact
            .get(value)
            .or_else(|| {
                self.wildcards
                    .iter()
                    .find(|(pattern, _)| pattern.matches(value))
                    .map(|(_, step)| step)
            })
            .or(self.default.as_ref())
    }
}

/// One node: its rule, if it has a `rate_limit`, and its children.
#[derive(Debug)]
pub(super) struct Step {
    rule: Option<usize>,
    children: Level,
}

impl Step {
    pub(super) fn new(rule: Option<usize>, children: Level) -> Step {
        Step { rule, children }
    }
}

/// A value pattern where each `*` matches zero or more characters, split once at load time.
#[derive(Debug)]
struct Pattern {
    prefix: String,
    /// Segments between stars, which must appear in order.
    middle: Vec<String>,
    suffix: String,
}

impl Pattern {
    /// `pattern` contains at least one `*`.
    fn new(pattern: &str) -> Pattern {
        let mut segments = pattern.split('*').map(str::to_owned);
        let prefix = segments.next().unwrap_or_default();
        let mut middle: Vec<String> = segments.collect();
        let suffix = middle.pop().unwrap_or_default();
        Pattern {
            prefix,
            middle,
            suffix,
        }
    }

    fn matches(&self, value: &str) -> bool {
        // Stripping the suffix from what is left after the prefix keeps the two from
        // overlapping (`bar*b` must not match `bar`).
        let Some(mut rest) = value
            .strip_prefix(self.prefix.as_str())
            .and_then(|rest| rest.strip_suffix(self.suffix.as_str()))
        else {
            return false;
        };
        for segment in &self.middle {
            match rest.find(segment.as_str()) {
                Some(at) => rest = &rest[at + segment.len()..],
                None => return false,
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::load_str;
    use super::*;
    use crate::decision::limit::Unit;

    /// The reference's conformance tree (its `basic_config.yaml` table), written afresh.
    const BASIC: &str = "\
domain: test-domain
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit: {unit: second, requests_per_unit: 5}
      - key: subkey1
        value: subvalue1
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key2
    value: value2
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: key2
    value: value3
  - key: key3
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: key4
    rate_limit: {unit: day, requests_per_unit: 1, name: key4_rate_limit}
  - key: key5
    value: value5
    rate_limit: {unit: day, requests_per_unit: 15}
    descriptors:
      - key: subkey5
        value: subvalue5
        rate_limit: {unit: day, requests_per_unit: 25}
  - key: key6
    rate_limit: {unlimited: true}
  - key: key7
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 70}
";

    const WILDCARD: &str = "\
domain: wild
descriptors:
  - key: wild
    value: foo*
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: noWild
    value: foo
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: midWild
    value: bar*b
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: multiWild
    value: foo*bar*baz
    rate_limit: {unit: minute, requests_per_unit: 4}
  - key: nestedWild
    value: val1
    descriptors:
      - key: wild
        value: goo*
        rate_limit: {unit: minute, requests_per_unit: 5}
  - key: pick
    value: a*
    rate_limit: {unit: second, requests_per_unit: 6}
  - key: pick
    value: ab*
    rate_limit: {unit: second, requests_per_unit: 7}
  - key: pick
    value: abc
    rate_limit: {unit: second, requests_per_unit: 8}
  - key: pick
    rate_limit: {unit: second, requests_per_unit: 9}
  - key: any
    value: '*'
    rate_limit: {unit: second, requests_per_unit: 10}
";

    fn rules(text: &str) -> RuleSet {
        load_str("rules.yaml", text).unwrap()
    }

    fn lookup<'r>(rules: &'r RuleSet, domain: &str, entries: &[(&str, &str)]) -> Option<&'r Rule> {
        rules.domain(domain)?.lookup(entries.iter().copied())
    }

    /// (requests_per_unit, unit, full_key) of the rule found, if it is limited.
    fn summary(rule: Option<&Rule>) -> Option<(u32, Unit, &str)> {
        let rule = rule?;
        let limit = rule.limit.as_ref()?;
        Some((limit.requests_per_unit, limit.unit, rule.full_key.as_str()))
    }

    #[test]
    fn conformance_table() {
        let rules = rules(BASIC);
        let find = |entries: &[(&str, &str)]| summary(lookup(&rules, "test-domain", entries));

        assert!(rules.domain("foo_domain").is_none());
        assert_eq!(find(&[("key1", "something")]), None);
        assert_eq!(find(&[("key1", "value1")]), None);
        assert_eq!(
            find(&[("key1", "value1"), ("subkey1", "something")]),
            Some((5, Unit::Second, "test-domain.key1_value1.subkey1"))
        );
        assert_eq!(
            find(&[("key1", "value1"), ("subkey1", "subvalue1")]),
            Some((
                10,
                Unit::Second,
                "test-domain.key1_value1.subkey1_subvalue1"
            ))
        );
        assert_eq!(
            find(&[("key2", "something")]),
            Some((20, Unit::Minute, "test-domain.key2"))
        );
        assert_eq!(
            find(&[("key2", "value2")]),
            Some((30, Unit::Minute, "test-domain.key2_value2"))
        );
        assert_eq!(find(&[("key2", "value2"), ("subkey", "subvalue")]), None);
        assert_eq!(find(&[("key2", "value3")]), None);
        assert_eq!(
            find(&[("key3", "foo")]),
            Some((1, Unit::Hour, "test-domain.key3"))
        );
        assert_eq!(
            lookup(&rules, "test-domain", &[("key3", "foo")])
                .unwrap()
                .name,
            None
        );
        let key4 = lookup(&rules, "test-domain", &[("key4", "foo")]).unwrap();
        assert_eq!(
            summary(Some(key4)),
            Some((1, Unit::Day, "test-domain.key4"))
        );
        assert_eq!(key4.name.as_deref(), Some("key4_rate_limit"));
        assert_eq!(
            find(&[("key5", "value5")]),
            Some((15, Unit::Day, "test-domain.key5_value5"))
        );
        assert_eq!(
            find(&[("key5", "value5"), ("subkey5", "subvalue5")]),
            Some((25, Unit::Day, "test-domain.key5_value5.subkey5_subvalue5"))
        );
        assert_eq!(find(&[("key5", "value5"), ("subkey5", "subvalue")]), None);
        let key6 = lookup(&rules, "test-domain", &[("key6", "foo")]).unwrap();
        assert_eq!(key6.limit, None);
        assert_eq!(key6.full_key, "test-domain.key6");
        let key7 = lookup(&rules, "test-domain", &[("key7", "unspecified_value")]).unwrap();
        assert_eq!(
            summary(Some(key7)),
            Some((70, Unit::Minute, "test-domain.key7"))
        );
        assert!(key7.detailed_metric);
        assert!(!key7.shadow_mode && !key7.quota_mode);
        assert_eq!(rules.domain("test-domain").unwrap().rule_count(), 10);
    }

    #[test]
    fn unknown_keys_and_empty_requests_get_no_rule() {
        let rules = rules(BASIC);
        assert!(lookup(&rules, "test-domain", &[("nope", "x")]).is_none());
        assert!(lookup(&rules, "test-domain", &[]).is_none());
        // Keys are case-sensitive.
        assert!(lookup(&rules, "test-domain", &[("KEY2", "value2")]).is_none());
    }

    #[test]
    fn a_miss_says_where_the_walk_stopped() {
        let rules = rules(BASIC);
        let domain = rules.domain("test-domain").unwrap();
        let table: [(&[(&str, &str)], Miss); 6] = [
            (&[], Miss::Empty),
            (&[("nope", "x")], Miss::NoKey { entry: 0 }),
            (&[("key1", "other")], Miss::NoValue { entry: 0 }),
            (&[("key1", "value1")], Miss::NoLimitHere),
            (&[("key2", "value3")], Miss::NoLimitHere),
            (
                &[("key3", "a"), ("extra", "x")],
                Miss::PastTheEnd { entry: 1 },
            ),
        ];
        for (entries, miss) in table {
            assert_eq!(
                domain.walk(entries.iter().copied()),
                Err(miss),
                "{entries:?}"
            );
        }
        let deeper = [("key1", "value1"), ("nope", "x")];
        assert_eq!(
            domain.walk(deeper.iter().copied()),
            Err(Miss::NoKey { entry: 1 })
        );
        let hit = [("key1", "value1"), ("subkey1", "x")];
        assert_eq!(
            domain.walk(hit.iter().copied()).unwrap().full_key,
            "test-domain.key1_value1.subkey1"
        );
    }

    #[test]
    fn depth_must_match_exactly() {
        let rules = rules(BASIC);
        // Longer than the config path: no rule, even though `key3` has one.
        assert!(lookup(&rules, "test-domain", &[("key3", "foo"), ("extra", "x")]).is_none());
        assert!(
            lookup(
                &rules,
                "test-domain",
                &[
                    ("key1", "value1"),
                    ("subkey1", "subvalue1"),
                    ("deeper", "x")
                ]
            )
            .is_none()
        );
    }

    #[test]
    fn no_backtracking_to_the_default_branch() {
        let rules = rules(
            "domain: d
\
             descriptors:
  \
               - key: a
    \
                 value: exact
    \
                 descriptors:
      \
                   - key: b
        \
                     value: one
        \
                     rate_limit: {unit: second, requests_per_unit: 1}
  \
               - key: a
    \
                 descriptors:
      \
                   - key: b
        \
                     rate_limit: {unit: second, requests_per_unit: 2}
",
        );
        let find = |entries: &[(&str, &str)]| summary(lookup(&rules, "d", entries)).map(|s| s.0);
        assert_eq!(find(&[("a", "exact"), ("b", "one")]), Some(1));
        // `a=exact` wins at the first level; its subtree has no `b=two`, and the default `a`
        // branch (which would match) is not tried.
        assert_eq!(find(&[("a", "exact"), ("b", "two")]), None);
        assert_eq!(find(&[("a", "other"), ("b", "two")]), Some(2));
    }

    #[test]
    fn empty_value_falls_back_to_the_key_only_node() {
        let rules = rules(BASIC);
        let find = |entries: &[(&str, &str)]| summary(lookup(&rules, "test-domain", entries));
        assert_eq!(
            find(&[("key2", "")]),
            Some((20, Unit::Minute, "test-domain.key2"))
        );
        assert_eq!(find(&[("key1", "")]), None);
        assert_eq!(
            find(&[("key1", "value1"), ("subkey1", "")]),
            Some((5, Unit::Second, "test-domain.key1_value1.subkey1"))
        );
    }

    #[test]
    fn wildcards() {
        let rules = rules(WILDCARD);
        let find = |key: &str, value: &str| summary(lookup(&rules, "wild", &[(key, value)]));

        assert_eq!(
            find("wild", "foo1"),
            Some((1, Unit::Minute, "wild.wild_foo*"))
        );
        assert_eq!(
            find("wild", "foo2"),
            Some((1, Unit::Minute, "wild.wild_foo*"))
        );
        assert_eq!(
            find("wild", "foo"),
            Some((1, Unit::Minute, "wild.wild_foo*"))
        );
        assert_eq!(find("wild", "bar"), None);
        assert_eq!(find("noWild", "foo1"), None);
        assert_eq!(
            find("noWild", "foo"),
            Some((2, Unit::Minute, "wild.noWild_foo"))
        );

        for value in ["barab", "bar123b", "barb"] {
            assert_eq!(
                find("midWild", value),
                Some((3, Unit::Minute, "wild.midWild_bar*b")),
                "{value}"
            );
        }
        for value in ["bara", "xbarb", "bar"] {
            assert_eq!(find("midWild", value), None, "{value}");
        }

        for value in ["foo123bar456baz", "foobarbaz"] {
            assert_eq!(find("multiWild", value).map(|s| s.0), Some(4), "{value}");
        }
        for value in ["foo123baz", "bar456baz"] {
            assert_eq!(find("multiWild", value), None, "{value}");
        }

        assert_eq!(
            summary(lookup(
                &rules,
                "wild",
                &[("nestedWild", "val1"), ("wild", "goober")]
            )),
            Some((5, Unit::Minute, "wild.nestedWild_val1.wild_goo*"))
        );
        // The pattern matches the value only: the key must be equal.
        assert_eq!(find("wil", "dfoo"), None);
        assert_eq!(find("any", ""), Some((10, Unit::Second, "wild.any_*")));
    }

    #[test]
    fn exact_beats_wildcard_beats_default_and_wildcards_go_in_config_order() {
        let rules = rules(WILDCARD);
        let find = |value: &str| summary(lookup(&rules, "wild", &[("pick", value)])).map(|s| s.0);
        assert_eq!(find("abc"), Some(8));
        // `a*` is listed before `ab*`, so it wins for `abd` too.
        assert_eq!(find("abd"), Some(6));
        assert_eq!(find("axe"), Some(6));
        assert_eq!(find("zzz"), Some(9));
    }

    #[test]
    fn describe_lists_every_rule_sorted() {
        let rules = rules(
            "domain: b
\
             descriptors:
  \
               - key: z
    \
                 shadow_mode: true
    \
                 rate_limit: {unit: second, requests_per_unit: 3}
  \
               - key: a
    \
                 quota_mode: true
    \
                 rate_limit: {unit: hour, requests_per_unit: 100, algorithm: token_bucket, burst: 20}
  \
               - key: path
    \
                 descriptors:
      \
                   - key: free
        \
                     rate_limit: {unlimited: true}
\
             ---
\
             domain: a
\
             descriptors:
  \
               - key: k
    \
                 value: v*
    \
                 rate_limit: {unit: day, requests_per_unit: 0, algorithm: sliding_window}
",
        );
        assert_eq!(
            rules.describe(),
            "a.k_v*: unit=DAY requests_per_unit=0, shadow_mode: false, quota_mode: false, algorithm: sliding_window\n\
             b.a: unit=HOUR requests_per_unit=100, shadow_mode: false, quota_mode: true, algorithm: token_bucket, burst: 20\n\
             b.path.free: unlimited\n\
             b.z: unit=SECOND requests_per_unit=3, shadow_mode: true, quota_mode: false, algorithm: fixed_window\n"
        );
        let names: Vec<&str> = rules.domains().map(DomainRules::name).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(rules.domain("b").unwrap().rule_count(), 3);
    }

    #[test]
    fn patterns_match_in_order_with_prefix_and_suffix() {
        let cases = [
            ("foo*", "foo", true),
            ("foo*", "foo123", true),
            ("foo*", "fo", false),
            ("*", "", true),
            ("*bar", "xbar", true),
            ("*bar", "barx", false),
            ("bar*b", "barab", true),
            ("bar*b", "bar123b", true),
            ("bar*b", "barb", true),
            ("bar*b", "bar", false),
            ("bar*b", "bara", false),
            ("bar*b", "xbarb", false),
            ("foo*bar*baz", "foo123bar456baz", true),
            ("foo*bar*baz", "foobarbaz", true),
            ("foo*bar*baz", "foo123baz", false),
            ("foo*bar*baz", "bar456baz", false),
            ("foo*bar*baz", "foobazbar", false),
            ("a*b*b", "abb", true),
            ("a*b*b", "ab", false),
            ("a**b", "ab", true),
        ];
        for (pattern, value, expected) in cases {
            assert_eq!(
                Pattern::new(pattern).matches(value),
                expected,
                "{pattern} vs {value}"
            );
        }
    }
    #[test]
    fn unordered_sets_take_the_rules_order() {
        let rules = rules(BASIC);
        let domain = rules.domain("test-domain").unwrap();
        // (bucket entries in any order, the rule's full key, the entries in the rule's order)
        type Entries<'a> = &'a [(&'a str, &'a str)];
        let cases: [(Entries, Option<(&str, Entries)>); 6] = [
            (
                &[("subkey1", "subvalue1"), ("key1", "value1")],
                Some((
                    "test-domain.key1_value1.subkey1_subvalue1",
                    &[("key1", "value1"), ("subkey1", "subvalue1")],
                )),
            ),
            (
                &[("key1", "value1"), ("subkey1", "other")],
                Some((
                    "test-domain.key1_value1.subkey1",
                    &[("key1", "value1"), ("subkey1", "other")],
                )),
            ),
            (
                &[("key2", "value2")],
                Some(("test-domain.key2_value2", &[("key2", "value2")])),
            ),
            // key5 -> subkey5 has a rule; subkey5 alone at the root does not.
            (
                &[("subkey5", "subvalue5"), ("key5", "value5")],
                Some((
                    "test-domain.key5_value5.subkey5_subvalue5",
                    &[("key5", "value5"), ("subkey5", "subvalue5")],
                )),
            ),
            // Every entry must be used, as with a descriptor.
            (&[("key2", "value2"), ("key3", "x")], None),
            (&[("key1", "value1")], None),
        ];
        for (entries, expected) in cases {
            let found = domain.lookup_set(entries);
            let found = found
                .as_ref()
                .map(|(rule, path)| (rule.full_key.as_str(), path.as_slice()));
            assert_eq!(found, expected, "{entries:?}");
        }
    }
}
