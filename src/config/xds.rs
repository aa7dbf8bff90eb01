//! Rules pushed by a control plane: the reference's xDS resource
//! (`ratelimit.config.ratelimit.v3.RateLimitConfig`) → the same rule model the YAML produces,
//! checked by the same validator, so a rule means the same and fails the same way whichever
//! way it arrives.
//!
//! xDS carries the reference's fields only: turnstile's YAML extensions (`algorithm`, `burst`,
//! `window`, `shards`, `lease`, a `rate_limit` list, `share_threshold`, `on_backend_error`)
//! have no field in that schema, so pushed rules are fixed windows as in the reference.
//!
//! Errors cannot point at a line, so each names its place in the resource instead
//! (`resource 'name' descriptors[0].rate_limit.unit: ...`).

use super::model::{DescriptorSpec, DomainSpec, RateLimitSpec, Spanned};
use super::validate::Validator;
use super::yaml::Pos;
use super::{ConfigError, RuleSet};

/// The generated messages of `proto/ratelimit/config/ratelimit/v3/rls_conf.proto`.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    include!(concat!(
        env!("OUT_DIR"),
        "/ratelimit.config.ratelimit.v3.rs"
    ));
}

/// The resource type a client subscribes to.
pub const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// Validates one complete push (every domain) into a rule set of version `version`; on
/// failure, every error found, one per line.
pub fn load(
    resources: &[pb::RateLimitConfig],
    merge_domains: bool,
    version: &str,
) -> Result<RuleSet, String> {
    let mut paths = FieldPaths::default();
    let mut validator = Validator::new(merge_domains);
    let mut errors = Vec::new();
    for resource in resources {
        let spec = paths.domain(resource);
        validator.add(&resource.name, &spec, &mut errors);
    }
    if !errors.is_empty() {
        return Err(paths.render(&errors));
    }
    let names = resources.iter().map(|r| r.name.clone()).collect();
    Ok(RuleSet::new(validator.finish(), version.to_owned(), names))
}

/// Stands in for source positions: each field that may be blamed gets a `Pos` whose line
/// indexes the path it was found at.
#[derive(Default)]
struct FieldPaths(Vec<String>);

impl FieldPaths {
    fn at(&mut self, path: String) -> Pos {
        self.0.push(path);
        Pos {
            line: self.0.len(),
            column: 1,
        }
    }

    fn render(&self, errors: &[ConfigError]) -> String {
        let lines: Vec<String> = errors
            .iter()
            .map(|e| {
                let place = self.0.get(e.line - 1).map_or("", String::as_str);
                format!("{place}: {}", e.message)
            })
            .collect();
        lines.join("\n")
    }

    fn domain(&mut self, resource: &pb::RateLimitConfig) -> DomainSpec {
        let root = format!("resource '{}'", resource.name);
        DomainSpec {
            domain: resource.domain.clone(),
            descriptors: self.descriptors(&root, &resource.descriptors),
            on_backend_error: None,
            pos: self.at(format!("{root} domain")),
        }
    }

    fn descriptors(
        &mut self,
        parent: &str,
        list: &[pb::RateLimitDescriptor],
    ) -> Vec<DescriptorSpec> {
        let separator = if parent.ends_with('\'') { " " } else { "." };
        list.iter()
            .enumerate()
            .map(|(i, d)| {
                let path = format!("{parent}{separator}descriptors[{i}]");
                DescriptorSpec {
                    key: d.key.clone(),
                    value: Some(d.value.clone()).filter(|v| !v.is_empty()),
                    rate_limits: d
                        .rate_limit
                        .as_ref()
                        .map(|p| self.policy(&path, p))
                        .into_iter()
                        .collect(),
                    shadow_mode: d.shadow_mode,
                    quota_mode: d.quota_mode,
                    detailed_metric: d.detailed_metric,
                    share_threshold: false,
                    metadata: d.metadata.as_ref().map(json_struct),
                    descriptors: self.descriptors(&path, &d.descriptors),
                    pos: self.at(path),
                }
            })
            .collect()
    }

    fn policy(&mut self, parent: &str, policy: &pb::RateLimitPolicy) -> RateLimitSpec {
        let path = format!("{parent}.rate_limit");
        // As the reference converts it: the enum's name, so UNKNOWN (unset) is an invalid
        // unit unless the policy is unlimited.
        let unit = pb::RateLimitUnit::try_from(policy.unit)
            .map_or_else(|_| policy.unit.to_string(), |u| u.as_str_name().to_owned());
        RateLimitSpec {
            unit: Some(Spanned {
                value: unit,
                pos: self.at(format!("{path}.unit")),
            }),
            requests_per_unit: Some(Spanned {
                value: policy.requests_per_unit,
                pos: self.at(format!("{path}.requests_per_unit")),
            }),
            unlimited: policy.unlimited,
            name: Some(policy.name.clone()).filter(|n| !n.is_empty()),
            replaces: policy
                .replaces
                .iter()
                .enumerate()
                .map(|(i, r)| Spanned {
                    value: r.name.clone(),
                    pos: self.at(format!("{path}.replaces[{i}]")),
                })
                .collect(),
            algorithm: None,
            burst: None,
            window: None,
            shards: None,
            lease: None,
            pos: self.at(path),
        }
    }
}

/// A `google.protobuf.Struct` as JSON data; whole numbers stay integers, as YAML reads them.
fn json_struct(s: &envoy_types::pb::google::protobuf::Struct) -> serde_json::Value {
    serde_json::Value::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), json_value(v)))
            .collect(),
    )
}

fn json_value(v: &envoy_types::pb::google::protobuf::Value) -> serde_json::Value {
    use envoy_types::pb::google::protobuf::value::Kind;
    use serde_json::Value;
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 9e15 => Value::from(*n as i64),
        Some(Kind::NumberValue(n)) => Value::from(*n),
        Some(Kind::StringValue(s)) => Value::String(s.clone()),
        Some(Kind::BoolValue(b)) => Value::Bool(*b),
        Some(Kind::StructValue(s)) => json_struct(s),
        Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(json_value).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::pb::{RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit};
    use super::*;

    fn policy(unit: RateLimitUnit, requests_per_unit: u32) -> Option<RateLimitPolicy> {
        Some(RateLimitPolicy {
            unit: unit as i32,
            requests_per_unit,
            ..Default::default()
        })
    }

    fn descriptor(
        key: &str,
        value: &str,
        rate_limit: Option<RateLimitPolicy>,
    ) -> RateLimitDescriptor {
        RateLimitDescriptor {
            key: key.into(),
            value: value.into(),
            rate_limit,
            ..Default::default()
        }
    }

    fn resource(
        name: &str,
        domain: &str,
        descriptors: Vec<RateLimitDescriptor>,
    ) -> RateLimitConfig {
        RateLimitConfig {
            name: name.into(),
            domain: domain.into(),
            descriptors,
        }
    }

    /// The same rules pushed and written as YAML compile to the same rules.
    #[test]
    fn a_push_means_what_the_same_yaml_means() {
        let mut nested = descriptor("k", "v", None);
        nested.descriptors = vec![descriptor("sub", "", policy(RateLimitUnit::Week, 7))];
        nested.shadow_mode = true;
        let mut named = descriptor("n", "", policy(RateLimitUnit::Minute, 5));
        named.rate_limit.as_mut().unwrap().name = "first".into();
        let mut replacing = descriptor("r", "", policy(RateLimitUnit::Second, 9));
        replacing.rate_limit.as_mut().unwrap().replaces = vec![pb::RateLimitReplace {
            name: "first".into(),
        }];
        let unlimited = descriptor(
            "u",
            "",
            Some(RateLimitPolicy {
                unlimited: true,
                ..Default::default()
            }),
        );
        let pushed = load(
            &[resource(
                "one",
                "d",
                vec![nested, named, replacing, unlimited],
            )],
            false,
            "v1",
        )
        .unwrap();
        let yaml = "domain: d\ndescriptors:\n\
            - {key: k, value: v, shadow_mode: true, descriptors: [{key: sub, rate_limit: {unit: week, requests_per_unit: 7}}]}\n\
            - {key: n, rate_limit: {unit: minute, requests_per_unit: 5, name: first}}\n\
            - {key: r, rate_limit: {unit: second, requests_per_unit: 9, replaces: [{name: first}]}}\n\
            - {key: u, rate_limit: {unlimited: true}}\n";
        let written = super::super::load_str("d.yaml", yaml).unwrap();
        assert_eq!(pushed.describe(), written.describe());
        assert!(!pushed.describe().is_empty());
        assert_eq!(pushed.version(), "v1");
        assert_eq!(pushed.files(), ["one"]);
    }

    #[test]
    fn metadata_becomes_json_with_integers_kept() {
        use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
        let value = |kind| Value { kind: Some(kind) };
        let mut d = descriptor("k", "", policy(RateLimitUnit::Hour, 1));
        d.metadata = Some(Struct {
            fields: [
                ("n".to_owned(), value(Kind::NumberValue(3.0))),
                ("f".to_owned(), value(Kind::NumberValue(0.5))),
                ("s".to_owned(), value(Kind::StringValue("x".into()))),
            ]
            .into(),
        });
        let rules = load(&[resource("r", "d", vec![d])], false, "1").unwrap();
        let rule = rules.domain("d").unwrap().lookup([("k", "any")]).unwrap();
        assert_eq!(
            rule.metadata,
            Some(serde_json::json!({"n": 3, "f": 0.5, "s": "x"}))
        );
    }

    /// Each row: resources, and the whole error text expected.
    #[test]
    fn bad_pushes_name_the_resource_and_field() {
        let cases: Vec<(Vec<RateLimitConfig>, &str)> = vec![
            (
                vec![resource(
                    "a",
                    "d",
                    vec![descriptor("k", "", policy(RateLimitUnit::Unknown, 1))],
                )],
                "resource 'a' descriptors[0].rate_limit.unit: invalid rate limit unit 'UNKNOWN'",
            ),
            (
                vec![resource("a", "", vec![])],
                "resource 'a' domain: config file cannot have empty domain",
            ),
            (
                vec![resource("a", "d", vec![]), resource("b", "d", vec![])],
                "resource 'b' domain: duplicate domain 'd' in config file",
            ),
            (
                vec![resource(
                    "a",
                    "d",
                    vec![RateLimitDescriptor {
                        key: "k".into(),
                        descriptors: vec![descriptor("", "v", policy(RateLimitUnit::Day, 1))],
                        ..Default::default()
                    }],
                )],
                "resource 'a' descriptors[0].descriptors[0]: descriptor has empty key",
            ),
            (
                vec![resource(
                    "a",
                    "d",
                    vec![
                        descriptor("k", "v", policy(RateLimitUnit::Day, 1)),
                        descriptor("k", "v", policy(RateLimitUnit::Day, 2)),
                    ],
                )],
                "resource 'a' descriptors[1]: duplicate descriptor composite key 'd.k_v'",
            ),
        ];
        for (resources, expected) in cases {
            assert_eq!(load(&resources, false, "1").unwrap_err(), expected);
        }
    }

    #[test]
    fn merged_domains_follow_the_setting() {
        let resources = [
            resource(
                "a",
                "d",
                vec![descriptor("x", "", policy(RateLimitUnit::Second, 1))],
            ),
            resource(
                "b",
                "d",
                vec![descriptor("y", "", policy(RateLimitUnit::Second, 2))],
            ),
        ];
        assert!(load(&resources, false, "1").is_err());
        let merged = load(&resources, true, "1").unwrap();
        let domain = merged.domain("d").unwrap();
        assert!(domain.lookup([("x", "1")]).is_some());
        assert!(domain.lookup([("y", "1")]).is_some());
    }
}
