//! The compiled, validated rules the service consults on every request.
//!
//! Children are stored by key, then by value, so a lookup borrows the request's strings and
//! builds nothing; the walk copies the reference's order (exact value, then wildcards in config
//! order, then the key-only default) and its lack of backtracking.

use std::collections::{BTreeMap, HashMap};

use crate::limit::{Algorithm, Limit};

/// Every loaded domain, and what they were loaded from.
#[derive(Debug)]
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
}

impl DomainRules {
    pub(super) fn new(name: String, root: Level, rules: Vec<Rule>) -> DomainRules {
        DomainRules { name, root, rules }
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
        let mut level = &self.root;
        let mut entries = entries.into_iter().peekable();
        while let Some((key, value)) = entries.next() {
            let step = level.keys.get(key)?.find(value)?;
            if entries.peek().is_none() {
                return step.rule.map(|i| &self.rules[i]);
            }
            level = &step.children;
        }
        None
    }
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
        if limit.algorithm == Algorithm::TokenBucket {
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
    use super::*;

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
}
