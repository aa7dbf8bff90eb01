//! The parse step: one marked YAML document → the rule model as written, before any rule is
//! checked for meaning.
//!
//! Key checking copies the reference: a flat allow-list applied to every map outside
//! `metadata`, so a known key in the wrong place is accepted and ignored. Scalars are read as
//! yaml.v2 reads them (YAML 1.1): `key: 200` is the string "200", `yes`/`on` are booleans.

use super::ConfigError;
use super::yaml::{self, Node, NodeKind, Pos};

/// The reference's allow-list plus our additive `algorithm`, `burst`, `window`, `shards`,
/// `lease` and `on_backend_error`.
const KNOWN_KEYS: [&str; 22] = [
    "domain",
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "unit",
    "requests_per_unit",
    "unlimited",
    "shadow_mode",
    "quota_mode",
    "name",
    "replaces",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
    "algorithm",
    "burst",
    "on_backend_error",
    "window",
    "shards",
    "lease",
];

/// A value with the position it was written at, for fields whose errors are found later.
#[derive(Debug, Clone, PartialEq)]
pub struct Spanned<T> {
    pub value: T,
    pub pos: Pos,
}

/// One YAML document: one domain.
#[derive(Debug)]
pub struct DomainSpec {
    /// Empty when missing or null.
    pub domain: String,
    pub descriptors: Vec<DescriptorSpec>,
    /// What to answer when the backend fails, for this domain.
    pub on_backend_error: Option<Spanned<String>>,
    /// The `domain` value, or the document when there is none.
    pub pos: Pos,
}

#[derive(Debug)]
pub struct DescriptorSpec {
    /// Empty when missing or null.
    pub key: String,
    /// `None` when missing, null or empty: the reference makes no difference.
    pub value: Option<String>,
    /// The `rate_limit` map, or each map of a `rate_limit` list (our extension: several
    /// limits on one descriptor, all enforced).
    pub rate_limits: Vec<RateLimitSpec>,
    pub shadow_mode: bool,
    pub quota_mode: bool,
    pub detailed_metric: bool,
    /// Every value matching this node's wildcard shares one counter.
    pub share_threshold: bool,
    /// Free-form data returned in the reference's response metadata when this rule passes.
    pub metadata: Option<serde_json::Value>,
    pub descriptors: Vec<DescriptorSpec>,
    pub pos: Pos,
}

#[derive(Debug)]
pub struct RateLimitSpec {
    pub unit: Option<Spanned<String>>,
    pub requests_per_unit: Option<Spanned<u32>>,
    pub unlimited: bool,
    /// `None` when missing or empty.
    pub name: Option<String>,
    /// Each entry's `name`, empty when it has none.
    pub replaces: Vec<Spanned<String>>,
    pub algorithm: Option<Spanned<String>>,
    pub burst: Option<Spanned<u32>>,
    /// A custom window, e.g. `30s`, `5m`.
    pub window: Option<Spanned<String>>,
    /// Split the limit over this many independent sub-limits (hot keys).
    pub shards: Option<Spanned<u32>>,
    /// Units taken per round trip to Redis and spent locally (hot keys).
    pub lease: Option<Spanned<u32>>,
    pub pos: Pos,
}

/// Reads one document. `None` only when the document cannot be a domain at all; every problem
/// found is pushed to `errors`, and the model is still returned so validation can report more.
pub fn parse(file: &str, document: &Node, errors: &mut Vec<ConfigError>) -> Option<DomainSpec> {
    let mut reader = Reader { file, errors };
    let mut spec = DomainSpec {
        domain: String::new(),
        descriptors: Vec::new(),
        on_backend_error: None,
        pos: document.pos,
    };
    match &document.kind {
        // Validation reports the missing domain.
        NodeKind::Null => {}
        NodeKind::Map(entries) => {
            reader.check_keys(document);
            for (key, value) in entries {
                match string_key(key) {
                    Some("domain") => {
                        spec.domain = reader.string(value, "domain").unwrap_or_default();
                        spec.pos = value.pos;
                    }
                    Some("descriptors") => spec.descriptors = reader.descriptors(value),
                    Some(name @ "on_backend_error") => {
                        spec.on_backend_error = reader.spanned_string(value, name)
                    }
                    _ => {}
                }
            }
        }
        _ => {
            reader.invalid(
                document,
                "config file",
                "a map with 'domain' and 'descriptors'",
            );
            return None;
        }
    }
    Some(spec)
}

/// A `metadata` node as data, scalars typed the way YAML 1.1 reads them.
fn json(node: &Node) -> serde_json::Value {
    use serde_json::Value;
    match &node.kind {
        NodeKind::Null => Value::Null,
        NodeKind::Scalar { text, plain: false } => Value::String(text.clone()),
        NodeKind::Scalar { text, plain: true } => {
            if let Some(b) = yaml::resolve_bool(text) {
                Value::Bool(b)
            } else if let Some(n) = yaml::resolve_int(text).and_then(|n| i64::try_from(n).ok()) {
                Value::from(n)
            } else if let Some(f) = yaml::is_float(text)
                .then(|| text.replace('_', "").parse::<f64>().ok())
                .flatten()
            {
                Value::from(f)
            } else {
                Value::String(text.clone())
            }
        }
        NodeKind::Seq(items) => Value::Array(items.iter().map(json).collect()),
        NodeKind::Map(entries) => Value::Object(
            entries
                .iter()
                .map(|(k, v)| {
                    let key = match &k.kind {
                        NodeKind::Scalar { text, .. } => text.clone(),
                        _ => String::new(),
                    };
                    (key, json(v))
                })
                .collect(),
        ),
    }
}

/// A map key as text, or `None` when YAML 1.1 reads it as something else (number, bool, null,
/// collection), which the reference rejects.
fn string_key(node: &Node) -> Option<&str> {
    match &node.kind {
        NodeKind::Scalar { text, plain: false } => Some(text),
        NodeKind::Scalar { text, plain: true }
            if yaml::resolve_bool(text).is_none()
                && yaml::resolve_int(text).is_none()
                && !yaml::is_float(text) =>
        {
            Some(text)
        }
        _ => None,
    }
}

struct Reader<'a> {
    file: &'a str,
    errors: &'a mut Vec<ConfigError>,
}

impl Reader<'_> {
    fn error(&mut self, pos: Pos, message: String) {
        self.errors.push(ConfigError::at(self.file, pos, message));
    }

    /// Reports a value of the wrong type, naming it.
    fn invalid(&mut self, node: &Node, field: &str, expected: &str) {
        let message = match &node.kind {
            NodeKind::Scalar { text, .. } => {
                format!("invalid {field} '{text}' (expected {expected})")
            }
            _ => format!(
                "invalid {field} (expected {expected}, found {})",
                node.describe()
            ),
        };
        self.error(node.pos, message);
    }

    /// The reference's key validation, over the whole document. Errors here are not reported
    /// again by the typed readers below, which skip what they cannot use.
    fn check_keys(&mut self, node: &Node) {
        match &node.kind {
            NodeKind::Map(entries) => {
                for (key, value) in entries {
                    match string_key(key) {
                        None => self.error(
                            key.pos,
                            format!(
                                "config error, key is not of type string: {}",
                                key.describe()
                            ),
                        ),
                        Some(name) if !KNOWN_KEYS.contains(&name) => {
                            self.error(key.pos, format!("config error, unknown key '{name}'"))
                        }
                        // Free-form, as in the reference.
                        Some("metadata") => {}
                        Some(_) => self.check_keys(value),
                    }
                }
            }
            NodeKind::Seq(items) => {
                for item in items {
                    if matches!(item.kind, NodeKind::Map(_)) {
                        self.check_keys(item);
                    } else {
                        self.error(
                            item.pos,
                            format!(
                                "config error, yaml file contains list of type other than map: {}",
                                item.describe()
                            ),
                        );
                    }
                }
            }
            NodeKind::Scalar { .. } | NodeKind::Null => {}
        }
    }

    fn descriptors(&mut self, node: &Node) -> Vec<DescriptorSpec> {
        match &node.kind {
            NodeKind::Seq(items) => items
                .iter()
                .filter_map(|item| match &item.kind {
                    NodeKind::Map(entries) => Some(self.descriptor(item.pos, entries)),
                    _ => None,
                })
                .collect(),
            NodeKind::Null => Vec::new(),
            _ => {
                self.invalid(node, "descriptors", "a list of maps");
                Vec::new()
            }
        }
    }

    fn descriptor(&mut self, pos: Pos, entries: &[(Node, Node)]) -> DescriptorSpec {
        let mut spec = DescriptorSpec {
            key: String::new(),
            value: None,
            rate_limits: Vec::new(),
            shadow_mode: false,
            quota_mode: false,
            detailed_metric: false,
            share_threshold: false,
            metadata: None,
            descriptors: Vec::new(),
            pos,
        };
        for (key, value) in entries {
            let Some(name) = string_key(key) else {
                continue;
            };
            match name {
                "key" => spec.key = self.string(value, name).unwrap_or_default(),
                "value" => spec.value = self.string(value, name).filter(|v| !v.is_empty()),
                "rate_limit" => spec.rate_limits = self.rate_limits(value),
                "descriptors" => spec.descriptors = self.descriptors(value),
                "shadow_mode" => spec.shadow_mode = self.boolean(value, name),
                "quota_mode" => spec.quota_mode = self.boolean(value, name),
                "detailed_metric" => spec.detailed_metric = self.boolean(value, name),
                "share_threshold" => spec.share_threshold = self.boolean(value, name),
                // Checked as the reference checks them but not kept: they only shape stats
                // keys and the reference's response metadata, which turnstile names its own way.
                "value_to_metric" => {
                    self.boolean(value, name);
                }
                "metadata" => match &value.kind {
                    NodeKind::Map(_) => spec.metadata = Some(json(value)),
                    NodeKind::Null => {}
                    _ => self.invalid(value, name, "a map"),
                },
                // Misplaced known keys are ignored, as in the reference; check_keys has
                // reported unknown ones.
                _ => {}
            }
        }
        if spec.share_threshold {
            let composite = match &spec.value {
                Some(value) => format!("{}_{value}", spec.key),
                None => spec.key.clone(),
            };
            if !composite.contains('*') {
                self.error(
                    pos,
                    format!(
                        "share_threshold can only be used with wildcard values (containing '*'), but found key '{composite}'"
                    ),
                );
            }
        }
        spec
    }

    /// A `rate_limit` map, or a list of them.
    fn rate_limits(&mut self, node: &Node) -> Vec<RateLimitSpec> {
        match &node.kind {
            NodeKind::Seq(items) => items
                .iter()
                .filter_map(|item| self.rate_limit(item))
                .collect(),
            _ => self.rate_limit(node).into_iter().collect(),
        }
    }

    fn rate_limit(&mut self, node: &Node) -> Option<RateLimitSpec> {
        let entries = match &node.kind {
            NodeKind::Map(entries) => entries,
            NodeKind::Null => return None,
            _ => {
                self.invalid(node, "rate_limit", "a map or a list of maps");
                return None;
            }
        };
        let mut spec = RateLimitSpec {
            unit: None,
            requests_per_unit: None,
            unlimited: false,
            name: None,
            replaces: Vec::new(),
            algorithm: None,
            burst: None,
            window: None,
            shards: None,
            lease: None,
            pos: node.pos,
        };
        for (key, value) in entries {
            let Some(name) = string_key(key) else {
                continue;
            };
            match name {
                "unit" => spec.unit = self.spanned_string(value, name),
                "requests_per_unit" => spec.requests_per_unit = self.uint(value, name),
                "unlimited" => spec.unlimited = self.boolean(value, name),
                "name" => spec.name = self.string(value, name).filter(|n| !n.is_empty()),
                "replaces" => spec.replaces = self.replaces(value),
                "algorithm" => spec.algorithm = self.spanned_string(value, name),
                "burst" => spec.burst = self.uint(value, name),
                "window" => spec.window = self.spanned_string(value, name),
                "shards" => spec.shards = self.uint(value, name),
                "lease" => spec.lease = self.uint(value, name),
                _ => {}
            }
        }
        Some(spec)
    }

    fn replaces(&mut self, node: &Node) -> Vec<Spanned<String>> {
        match &node.kind {
            NodeKind::Seq(items) => items
                .iter()
                .filter_map(|item| match &item.kind {
                    NodeKind::Map(entries) => {
                        let name = entries
                            .iter()
                            .rev()
                            .find(|(key, _)| string_key(key) == Some("name"))
                            .and_then(|(_, value)| self.string(value, "name"));
                        Some(Spanned {
                            value: name.unwrap_or_default(),
                            pos: item.pos,
                        })
                    }
                    _ => None,
                })
                .collect(),
            NodeKind::Null => Vec::new(),
            _ => {
                self.invalid(node, "replaces", "a list of maps");
                Vec::new()
            }
        }
    }

    /// Any scalar is text (yaml.v2 stores `200` or `true` in a string field as written).
    fn string(&mut self, node: &Node, field: &str) -> Option<String> {
        match &node.kind {
            NodeKind::Scalar { text, .. } => Some(text.clone()),
            NodeKind::Null => None,
            _ => {
                self.invalid(node, field, "a string");
                None
            }
        }
    }

    fn spanned_string(&mut self, node: &Node, field: &str) -> Option<Spanned<String>> {
        self.string(node, field).map(|value| Spanned {
            value,
            pos: node.pos,
        })
    }

    /// Null is false, as a missing field.
    fn boolean(&mut self, node: &Node, field: &str) -> bool {
        let value = match &node.kind {
            NodeKind::Null => Some(false),
            NodeKind::Scalar { text, plain: true } => yaml::resolve_bool(text),
            _ => None,
        };
        value.unwrap_or_else(|| {
            self.invalid(node, field, "true or false");
            false
        })
    }

    /// Null is `None`, as a missing field.
    fn uint(&mut self, node: &Node, field: &str) -> Option<Spanned<u32>> {
        let value = match &node.kind {
            NodeKind::Null => return None,
            NodeKind::Scalar { text, plain: true } => {
                yaml::resolve_int(text).and_then(|n| u32::try_from(n).ok())
            }
            _ => None,
        };
        if value.is_none() {
            self.invalid(node, field, &format!("an integer from 0 to {}", u32::MAX));
        }
        value.map(|value| Spanned {
            value,
            pos: node.pos,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> (Option<DomainSpec>, Vec<String>) {
        let documents = yaml::parse("t.yaml", text).unwrap();
        let mut errors = Vec::new();
        let spec = parse("t.yaml", &documents[0], &mut errors);
        (spec, errors.iter().map(ToString::to_string).collect())
    }

    fn errors_of(text: &str) -> Vec<String> {
        read(text).1
    }

    #[test]
    fn reads_the_model_with_positions() {
        let (spec, errors) = read(
            "domain: d\n\
             descriptors:\n  \
               - key: k\n    \
                 value: 200\n    \
                 shadow_mode: yes\n    \
                 quota_mode: On\n    \
                 detailed_metric: TRUE\n    \
                 rate_limit:\n      \
                   unit: minute\n      \
                   requests_per_unit: 010\n      \
                   name: n\n      \
                   replaces: [{name: a}, {name: b}]\n      \
                   algorithm: token_bucket\n      \
                   burst: 0x10\n    \
                 descriptors:\n      \
                   - key: sub\n",
        );
        assert_eq!(errors, Vec::<String>::new());
        let spec = spec.unwrap();
        assert_eq!(spec.domain, "d");
        assert_eq!(spec.pos, Pos { line: 1, column: 9 });
        let d = &spec.descriptors[0];
        assert_eq!(d.key, "k");
        assert_eq!(d.value.as_deref(), Some("200"));
        assert_eq!(d.pos, Pos { line: 3, column: 5 });
        assert!(d.shadow_mode && d.quota_mode && d.detailed_metric);
        let rl = d.rate_limits.first().unwrap();
        assert_eq!(rl.pos, Pos { line: 9, column: 7 });
        assert_eq!(
            rl.unit,
            Some(Spanned {
                value: "minute".to_owned(),
                pos: Pos {
                    line: 9,
                    column: 13
                }
            })
        );
        // YAML 1.1, as the reference reads it: a leading 0 is octal.
        assert_eq!(rl.requests_per_unit.as_ref().unwrap().value, 8);
        assert!(!rl.unlimited);
        assert_eq!(rl.name.as_deref(), Some("n"));
        let replaces: Vec<&str> = rl.replaces.iter().map(|r| r.value.as_str()).collect();
        assert_eq!(replaces, ["a", "b"]);
        assert_eq!(rl.algorithm.as_ref().unwrap().value, "token_bucket");
        assert_eq!(rl.burst.as_ref().unwrap().value, 16);
        assert_eq!(d.descriptors[0].key, "sub");
        assert_eq!(d.descriptors[0].value, None);
        assert!(d.descriptors[0].rate_limits.is_empty());
    }

    #[test]
    fn unknown_keys_anywhere_are_reported_at_the_key() {
        assert_eq!(
            errors_of("domain: d\ndescriptors:\n  - key: k\n    ratelimit:\n      unit: second\n"),
            ["t.yaml:4:5: config error, unknown key 'ratelimit'"]
        );
        assert_eq!(
            errors_of(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      requestsperunit: 5\n      unit: second\n"
            ),
            ["t.yaml:5:7: config error, unknown key 'requestsperunit'"]
        );
    }

    #[test]
    fn misplaced_known_keys_are_accepted_and_ignored() {
        let (spec, errors) =
            read("domain: d\nrequests_per_unit: 5\ndescriptors:\n  - key: k\n    unit: second\n");
        assert!(errors.is_empty(), "{errors:?}");
        let spec = spec.unwrap();
        assert_eq!(spec.descriptors[0].key, "k");
        assert!(spec.descriptors[0].rate_limits.is_empty());
    }

    #[test]
    fn metadata_is_free_form_but_must_be_a_map() {
        let (_, errors) = read(
            "domain: d\ndescriptors:\n  - key: k\n    metadata:\n      anything: [1, 2]\n      0.5: x\n",
        );
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(
            errors_of("domain: d\ndescriptors:\n  - key: k\n    metadata: text\n"),
            ["t.yaml:4:15: invalid metadata 'text' (expected a map)"]
        );
    }

    #[test]
    fn non_string_keys_are_reported() {
        assert_eq!(
            errors_of("domain: d\n0.25: x\n"),
            ["t.yaml:2:1: config error, key is not of type string: 0.25"]
        );
        assert_eq!(
            errors_of("domain: d\ndescriptors:\n  - key: k\n    42: x\n    true: y\n"),
            [
                "t.yaml:4:5: config error, key is not of type string: 42",
                "t.yaml:5:5: config error, key is not of type string: true"
            ]
        );
        // Quoted, it is a string key (and then an unknown one).
        assert_eq!(
            errors_of("domain: d\n'0.25': x\n"),
            ["t.yaml:2:1: config error, unknown key '0.25'"]
        );
    }

    #[test]
    fn list_elements_must_be_maps() {
        assert_eq!(
            errors_of("domain: d\ndescriptors: [a, b]\n"),
            [
                "t.yaml:2:15: config error, yaml file contains list of type other than map: a",
                "t.yaml:2:18: config error, yaml file contains list of type other than map: b"
            ]
        );
        assert_eq!(
            errors_of(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      replaces:\n        - other\n"
            ),
            ["t.yaml:6:11: config error, yaml file contains list of type other than map: other"]
        );
    }

    #[test]
    fn typed_fields_name_the_bad_value() {
        let rl = |body: &str| {
            errors_of(&format!(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      {body}\n"
            ))
        };
        assert_eq!(
            rl("requests_per_unit: 1.5"),
            [
                "t.yaml:5:26: invalid requests_per_unit '1.5' (expected an integer from 0 to 4294967295)"
            ]
        );
        assert_eq!(
            rl("requests_per_unit: 4294967296"),
            [
                "t.yaml:5:26: invalid requests_per_unit '4294967296' (expected an integer from 0 to 4294967295)"
            ]
        );
        assert_eq!(
            rl("requests_per_unit: -1"),
            [
                "t.yaml:5:26: invalid requests_per_unit '-1' (expected an integer from 0 to 4294967295)"
            ]
        );
        assert_eq!(
            rl("requests_per_unit: '10'"),
            [
                "t.yaml:5:26: invalid requests_per_unit '10' (expected an integer from 0 to 4294967295)"
            ]
        );
        assert_eq!(
            rl("burst: []"),
            ["t.yaml:5:14: invalid burst (expected an integer from 0 to 4294967295, found a list)"]
        );
        assert_eq!(
            rl("unlimited: maybe"),
            ["t.yaml:5:18: invalid unlimited 'maybe' (expected true or false)"]
        );
        assert_eq!(
            rl("unit: {a: b}"),
            [
                "t.yaml:5:14: config error, unknown key 'a'",
                "t.yaml:5:13: invalid unit (expected a string, found a map)"
            ]
        );
        assert_eq!(
            errors_of("domain: d\ndescriptors:\n  - key: k\n    rate_limit: 5\n"),
            ["t.yaml:4:17: invalid rate_limit '5' (expected a map or a list of maps)"]
        );
        assert_eq!(
            errors_of("domain: d\ndescriptors: all\n"),
            ["t.yaml:2:14: invalid descriptors 'all' (expected a list of maps)"]
        );
        assert_eq!(
            errors_of("domain: d\ndescriptors:\n  - key: k\n    shadow_mode: \"true\"\n"),
            ["t.yaml:4:18: invalid shadow_mode 'true' (expected true or false)"]
        );
    }

    #[test]
    fn nulls_read_as_missing() {
        let (spec, errors) = read(
            "domain: d\ndescriptors:\n  - key: k\n    value: ''\n    shadow_mode: ~\n    rate_limit:\n      name:\n      requests_per_unit: null\n      replaces:\n        - name:\n",
        );
        assert!(errors.is_empty(), "{errors:?}");
        let d = &spec.unwrap().descriptors[0];
        assert_eq!(d.value, None);
        assert!(!d.shadow_mode);
        let rl = d.rate_limits.first().unwrap();
        assert_eq!(rl.name, None);
        assert_eq!(rl.requests_per_unit, None);
        assert_eq!(rl.replaces[0].value, "");
        assert_eq!(
            rl.replaces[0].pos,
            Pos {
                line: 10,
                column: 11
            }
        );
    }

    #[test]
    fn share_threshold_needs_a_wildcard() {
        assert_eq!(
            errors_of(
                "domain: d\ndescriptors:\n  - key: files\n    value: abc\n    share_threshold: true\n"
            ),
            [
                "t.yaml:3:5: share_threshold can only be used with wildcard values (containing '*'), but found key 'files_abc'"
            ]
        );
        let (_, errors) = read(
            "domain: d\ndescriptors:\n  - key: files\n    value: a*c\n    share_threshold: true\n    value_to_metric: false\n",
        );
        assert!(errors.is_empty(), "{errors:?}");
    }

    #[test]
    fn a_document_that_is_not_a_map_is_rejected() {
        let (spec, errors) = read("- a\n- b\n");
        assert!(spec.is_none());
        assert_eq!(
            errors,
            [
                "t.yaml:1:1: invalid config file (expected a map with 'domain' and 'descriptors', found a list)"
            ]
        );
        let (spec, errors) = read("just text\n");
        assert!(spec.is_none());
        assert_eq!(
            errors,
            [
                "t.yaml:1:1: invalid config file 'just text' (expected a map with 'domain' and 'descriptors')"
            ]
        );
    }
}
