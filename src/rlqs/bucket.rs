//! A bucket id matched to a rule the way a descriptor is, so one set of rules governs both
//! protocols. A bucket id is a map, so its entries carry no order: the rule tree supplies it
//! (`DomainRules::lookup_set`), and the limit's state is named as a descriptor's would be.

use crate::config::DomainRules;
use crate::decision::key::limit_key;
use crate::decision::limit::Limit;
use crate::service::plan::shared_entries;
use crate::service::request::Bounds;

/// What governs a bucket.
#[derive(Debug, Clone, PartialEq)]
pub enum Target<'r> {
    /// No rule covers it, the id is out of bounds, or its rule cannot be split into local
    /// token buckets (a concurrency limit): not limited, as such a descriptor would not be.
    Uncovered,
    /// An `unlimited` or shadow-mode rule: admit everything (usage is still counted).
    Unlimited { stats_key: &'r str },
    Limited {
        /// The limit's state key, as `crate::service::plan` builds it for the same descriptor.
        key: String,
        limit: Limit,
        stats_key: &'r str,
    },
}

/// The bucket id's entries sorted by key, or `None` when they break `bounds` (the same
/// bounds as a descriptor's).
pub fn entries<'b>(
    bucket: impl IntoIterator<Item = (&'b String, &'b String)>,
    bounds: &Bounds,
) -> Option<Vec<(&'b str, &'b str)>> {
    let mut entries: Vec<(&str, &str)> = bucket
        .into_iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let bytes: usize = entries.iter().map(|(k, v)| k.len() + v.len()).sum();
    let valid = !entries.is_empty()
        && entries.len() <= bounds.max_entries
        && bytes <= bounds.max_descriptor_bytes
        && entries.iter().all(|(k, _)| !k.is_empty());
    entries.sort_unstable();
    valid.then_some(entries)
}

pub fn target<'r>(domain: &'r DomainRules, entries: &[(&str, &str)]) -> Target<'r> {
    let Some((rule, path)) = domain.lookup_set(entries) else {
        return Target::Uncovered;
    };
    let stats_key = rule.full_key.as_str();
    match rule.limit {
        None => Target::Unlimited { stats_key },
        Some(_) if rule.shadow_mode => Target::Unlimited { stats_key },
        Some(limit) if limit.algorithm.in_flight() => Target::Uncovered,
        Some(limit) => Target::Limited {
            key: limit_key(
                domain.name(),
                shared_entries(&path, &rule.shared),
                &limit,
                None,
            ),
            limit,
            stats_key,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::load_str;
    use std::collections::HashMap;

    const RULES: &str = "\
domain: rlqs
descriptors:
  - key: tenant
    descriptors:
      - key: name
        value: api
        rate_limit: {unit: second, requests_per_unit: 100}
  - key: name
    value: free
    rate_limit: {unlimited: true}
  - key: name
    value: shadow
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: name
    value: conn
    descriptors:
      - key: request
        rate_limit: {unit: second, requests_per_unit: 5, algorithm: concurrency}
";

    #[test]
    fn buckets_match_rules_as_descriptors_do() {
        let rules = load_str("rules.yaml", RULES).unwrap();
        let domain = rules.domain("rlqs").unwrap();
        let bounds = Bounds::default();
        let long = "x".repeat(bounds.max_descriptor_bytes + 1);
        let bucket = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let target_of = |pairs: &[(&str, &str)]| {
            let id = bucket(pairs);
            entries(&id, &bounds).map(|e| match target(domain, &e) {
                Target::Limited { key, stats_key, .. } => format!("{stats_key} {key}"),
                other => format!("{other:?}"),
            })
        };
        type Entries<'a> = &'a [(&'a str, &'a str)];
        let cases: [(Entries, Option<&str>); 7] = [
            (
                &[("name", "api"), ("tenant", "a")],
                Some("rlqs.tenant.name_api rlqs|tenant=a|name=api|fixed_window:1"),
            ),
            (
                &[("name", "free")],
                Some("Unlimited { stats_key: \"rlqs.name_free\" }"),
            ),
            (
                &[("name", "shadow")],
                Some("Unlimited { stats_key: \"rlqs.name_shadow\" }"),
            ),
            (&[("request", "r1"), ("name", "conn")], Some("Uncovered")),
            (&[("name", "api")], Some("Uncovered")),
            (&[], None),
            (&[("name", &long)], None),
        ];
        for (pairs, expected) in cases {
            assert_eq!(target_of(pairs).as_deref(), expected, "{pairs:?}");
        }
    }
}
