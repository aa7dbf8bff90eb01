//! The validate step: the rule model → compiled domains, with the reference's error texts.
//!
//! Every check runs even after one fails, so a load reports all problems at once; the compiled
//! result is only used when there were none.

use std::collections::{BTreeMap, HashSet};

use super::ConfigError;
use super::matcher::{DomainRules, Level, Rule, Step};
use super::model::{DescriptorSpec, DomainSpec, RateLimitSpec};
use super::yaml::Pos;
use crate::decision::FailurePolicy;
use crate::decision::limit::{Algorithm, Limit, Unit};

/// The most sub-limits one limit may be split over.
pub const MAX_SHARDS: u32 = 64;

/// Accumulates domains across documents and files, rejecting duplicates (or, with
/// `merge_domains`, merging a domain's descriptors across files, as the reference's
/// MERGE_DOMAIN_CONFIG does: a descriptor defined twice is still an error).
#[derive(Default)]
pub struct Validator {
    merge_domains: bool,
    domains: BTreeMap<String, DomainBuilder>,
}

/// One domain being compiled; merged files keep adding to it.
#[derive(Default)]
struct DomainBuilder {
    root: Level,
    /// Composite keys at the root, for duplicate checks across merged files.
    seen: HashSet<String>,
    rules: Vec<Rule>,
    on_backend_error: Option<FailurePolicy>,
}

impl Validator {
    pub fn new(merge_domains: bool) -> Validator {
        Validator {
            merge_domains,
            domains: BTreeMap::new(),
        }
    }

    pub fn add(&mut self, file: &str, spec: &DomainSpec, errors: &mut Vec<ConfigError>) {
        let mut check = Check { file, errors };
        let on_backend_error = spec.on_backend_error.as_ref().and_then(|policy| {
            let parsed = FailurePolicy::parse(&policy.value);
            if parsed.is_none() {
                check.error(
                    policy.pos,
                    format!(
                        "invalid on_backend_error '{}' (expected error, allow, deny or local)",
                        policy.value
                    ),
                );
            }
            parsed
        });
        let known = self.domains.contains_key(&spec.domain);
        if spec.domain.is_empty() {
            check.error(spec.pos, "config file cannot have empty domain".to_owned());
        } else if known && !self.merge_domains {
            check.error(
                spec.pos,
                format!("duplicate domain '{}' in config file", spec.domain),
            );
        }
        // Compiled even when the domain is refused, so its own errors are reported too.
        let mut scratch = DomainBuilder::default();
        let domain = if spec.domain.is_empty() || (known && !self.merge_domains) {
            &mut scratch
        } else {
            self.domains.entry(spec.domain.clone()).or_default()
        };
        check.fill(
            &mut domain.root,
            &mut domain.seen,
            &spec.domain,
            &mut Vec::new(),
            &spec.descriptors,
            &mut domain.rules,
        );
        match (domain.on_backend_error, on_backend_error) {
            (Some(before), Some(now)) if before != now => check.error(
                spec.on_backend_error.as_ref().map_or(spec.pos, |p| p.pos),
                format!(
                    "on_backend_error '{now}' conflicts with '{before}' set for domain '{}' in another file",
                    spec.domain
                ),
            ),
            (None, Some(now)) => domain.on_backend_error = Some(now),
            _ => {}
        }
    }

    pub fn finish(self) -> BTreeMap<String, DomainRules> {
        self.domains
            .into_iter()
            .map(|(name, d)| {
                let rules = DomainRules::new(name.clone(), d.root, d.rules, d.on_backend_error);
                (name, rules)
            })
            .collect()
    }
}

struct Check<'a> {
    file: &'a str,
    errors: &'a mut Vec<ConfigError>,
}

impl Check<'_> {
    fn error(&mut self, pos: Pos, message: String) {
        self.errors.push(ConfigError::at(self.file, pos, message));
    }

    /// Compiles one level; `parent` is the full key of the node that owns it, `shared` the
    /// `share_threshold` patterns on the way to it.
    fn level(
        &mut self,
        parent: &str,
        shared: &mut Vec<Option<String>>,
        specs: &[DescriptorSpec],
        rules: &mut Vec<Rule>,
    ) -> Level {
        let mut level = Level::default();
        self.fill(
            &mut level,
            &mut HashSet::new(),
            parent,
            shared,
            specs,
            rules,
        );
        level
    }

    /// Adds `specs` to `level`, whose composite keys so far are `seen`.
    fn fill(
        &mut self,
        level: &mut Level,
        seen: &mut HashSet<String>,
        parent: &str,
        shared: &mut Vec<Option<String>>,
        specs: &[DescriptorSpec],
        rules: &mut Vec<Rule>,
    ) {
        // The reference keys a level by `key` or `key_value`; duplicates are judged the same way.
        for spec in specs {
            if spec.key.is_empty() {
                self.error(spec.pos, "descriptor has empty key".to_owned());
            }
            let composite = match &spec.value {
                Some(value) => format!("{}_{value}", spec.key),
                None => spec.key.clone(),
            };
            let full_key = format!("{parent}.{composite}");
            if !seen.insert(composite) {
                self.error(
                    spec.pos,
                    format!("duplicate descriptor composite key '{full_key}'"),
                );
            }
            shared.push(
                spec.value
                    .clone()
                    .filter(|v| spec.share_threshold && v.contains('*')),
            );
            let rule = spec.rate_limits.split_first().map(|(first, others)| {
                let mut rule = self.rule(spec, first, others, full_key.clone());
                if shared.iter().any(Option::is_some) {
                    rule.shared = shared.clone();
                }
                let in_flight = |l: &Limit| l.algorithm.in_flight();
                if rule.limit.iter().chain(&rule.also).any(in_flight) {
                    // The last entry names the request (its permit); the limit counts per the
                    // entries before it, so that value is left out of the state's key.
                    if shared.len() < 2 {
                        self.error(
                            spec.pos,
                            "a concurrency limit needs a last descriptor entry naming the request \
                             (such as x-request-id), below the entries naming what is limited"
                                .to_owned(),
                        );
                    }
                    rule.shared = shared.clone();
                    if let Some(last) = rule.shared.last_mut() {
                        *last = Some("*".to_owned());
                    }
                }
                rules.push(rule);
                rules.len() - 1
            });
            let children = self.level(&full_key, shared, &spec.descriptors, rules);
            shared.pop();
            level.insert(&spec.key, spec.value.as_deref(), Step::new(rule, children));
        }
    }

    /// A rule from its `rate_limit`, or from the maps of a `rate_limit` list: the first
    /// carries the rule's `name` and `replaces`, the `others` are further limits on the same
    /// descriptor, all enforced.
    fn rule(
        &mut self,
        spec: &DescriptorSpec,
        rate_limit: &RateLimitSpec,
        others: &[RateLimitSpec],
        full_key: String,
    ) -> Rule {
        let limit = if rate_limit.unlimited {
            self.unlimited(rate_limit);
            None
        } else {
            self.limit(rate_limit)
        };
        let mut also = Vec::with_capacity(others.len());
        for other in others {
            if rate_limit.unlimited || other.unlimited {
                self.error(
                    other.pos,
                    "unlimited cannot be combined with other limits".to_owned(),
                );
            }
            if other.name.is_some() || !other.replaces.is_empty() {
                self.error(
                    other.pos,
                    "name and replaces belong on the first limit of a rate_limit list".to_owned(),
                );
            }
            also.extend(self.limit(other));
        }
        for entry in &rate_limit.replaces {
            if entry.value.is_empty() {
                self.error(
                    entry.pos,
                    "should not have an empty replaces entry".to_owned(),
                );
            } else if rate_limit.name.as_ref() == Some(&entry.value) {
                self.error(
                    entry.pos,
                    "replaces should not contain name of same descriptor".to_owned(),
                );
            }
        }
        Rule {
            name: rate_limit.name.clone(),
            full_key,
            limit,
            also,
            shards: self.shards(rate_limit, limit.as_ref()),
            metadata: spec.metadata.clone(),
            shared: Vec::new(),
            shadow_mode: spec.shadow_mode,
            quota_mode: spec.quota_mode,
            detailed_metric: spec.detailed_metric,
            replaces: rate_limit
                .replaces
                .iter()
                .map(|r| r.value.clone())
                .collect(),
        }
    }

    /// `shards`: at least 1, at most the limit (each shard must admit something) and at most
    /// MAX_SHARDS.
    fn shards(&mut self, rate_limit: &RateLimitSpec, limit: Option<&Limit>) -> u32 {
        let Some(shards) = &rate_limit.shards else {
            return 1;
        };
        let most = limit.map_or(1, |l| l.requests_per_unit.min(MAX_SHARDS));
        if shards.value == 0 || shards.value > most {
            self.error(
                shards.pos,
                format!(
                    "shards must be from 1 to {most} (at most {MAX_SHARDS}, and at most requests_per_unit), found {}",
                    shards.value
                ),
            );
            return 1;
        }
        shards.value
    }

    /// An unlimited rule enforces nothing, so fields that shape a limit are mistakes. Like the
    /// reference, an invalid unit is tolerated here and `requests_per_unit` is ignored.
    fn unlimited(&mut self, rate_limit: &RateLimitSpec) {
        if let Some(unit) = &rate_limit.unit
            && Unit::parse(&unit.value).is_some()
        {
            self.error(
                unit.pos,
                "should not specify rate limit unit when unlimited".to_owned(),
            );
        }
        if let Some(algorithm) = &rate_limit.algorithm {
            self.error(
                algorithm.pos,
                "should not specify algorithm when unlimited".to_owned(),
            );
        }
        if let Some(burst) = &rate_limit.burst {
            self.error(
                burst.pos,
                "should not specify burst when unlimited".to_owned(),
            );
        }
    }

    fn limit(&mut self, rate_limit: &RateLimitSpec) -> Option<Limit> {
        let window = rate_limit.window.as_ref().map(|window| {
            let seconds = parse_window(&window.value);
            if seconds.is_none() {
                self.error(
                    window.pos,
                    format!(
                        "invalid window '{}' (expected a duration from 1s to 365d, such as 30s, 5m, 2h or 7d)",
                        window.value
                    ),
                );
            }
            seconds
        });
        // With a custom window the unit is optional: answers then report the longest unit
        // that fits in the window.
        let unit = match (&rate_limit.unit, window) {
            (None, Some(Some(seconds))) => {
                Unit::ALL.into_iter().rev().find(|u| u.seconds() <= seconds)
            }
            (None, Some(None)) => None,
            (given, _) => {
                let (unit_text, unit_pos) = match given {
                    Some(unit) => (unit.value.as_str(), unit.pos),
                    None => ("", rate_limit.pos),
                };
                let unit = Unit::parse(unit_text);
                if unit.is_none() {
                    self.error(unit_pos, format!("invalid rate limit unit '{unit_text}'"));
                }
                unit
            }
        };

        let algorithm = match &rate_limit.algorithm {
            None => Some(Algorithm::default()),
            Some(name) => {
                let algorithm = Algorithm::parse(&name.value);
                if algorithm.is_none() {
                    self.error(
                        name.pos,
                        format!(
                            "invalid algorithm '{}' (expected {})",
                            name.value,
                            algorithms(|_| true)
                        ),
                    );
                }
                algorithm
            }
        };

        // Missing means 0, as in the reference: every request is over the limit.
        let requests_per_unit = rate_limit.requests_per_unit.as_ref().map_or(0, |r| r.value);
        if let Some(given) = &rate_limit.requests_per_unit
            && let Some(chosen) = algorithm
            && let Some(max) = chosen.max_limit()
            && given.value > max
        {
            // A rate has another algorithm without that state; requests in flight do not.
            let instead = if chosen.in_flight() {
                String::new()
            } else {
                format!("; use {} for larger limits", Algorithm::TokenBucket)
            };
            self.error(
                given.pos,
                format!(
                    "{chosen} keeps state per request it counts, so requests_per_unit must be at \
                     most {max} (found {}){instead}",
                    given.value,
                ),
            );
        }

        let burst = match &rate_limit.burst {
            None => requests_per_unit,
            Some(burst) => {
                if algorithm.is_some_and(|a| !a.takes_burst()) {
                    self.error(
                        burst.pos,
                        format!(
                            "burst can only be used with algorithm {}",
                            algorithms(Algorithm::takes_burst)
                        ),
                    );
                } else if burst.value == 0 {
                    self.error(burst.pos, "burst must be at least 1".to_owned());
                }
                burst.value
            }
        };

        let lease = match &rate_limit.lease {
            None => 0,
            Some(lease) => {
                let most = burst.min(requests_per_unit);
                if !algorithm.is_some_and(Algorithm::batches) {
                    self.error(
                        lease.pos,
                        format!(
                            "lease can only be used with algorithm {}",
                            algorithms(Algorithm::batches)
                        ),
                    );
                } else if lease.value == 0 || lease.value > most {
                    self.error(
                        lease.pos,
                        format!(
                            "lease must be from 1 to {most} (the limit, and the burst), found {}",
                            lease.value
                        ),
                    );
                }
                lease.value
            }
        };
        let unit = unit?;
        Some(Limit {
            requests_per_unit,
            unit,
            algorithm: algorithm?,
            burst,
            window: match window {
                Some(seconds) => seconds?,
                None => unit.seconds(),
            },
            quota_lease: lease,
        })
    }
}

/// The names of the algorithms that `have` something, as "a, b or c".
fn algorithms(have: impl Fn(Algorithm) -> bool) -> String {
    let names: Vec<&str> = Algorithm::ALL
        .into_iter()
        .filter(|&k| have(k))
        .map(Algorithm::name)
        .collect();
    match names.split_last() {
        Some((last, [])) => (*last).to_owned(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// `30s`, `5m`, `2h`, `7d` or plain seconds, from 1 second to 365 days.
fn parse_window(text: &str) -> Option<u64> {
    let (number, scale) = match text.char_indices().last()? {
        (i, 's') => (&text[..i], 1),
        (i, 'm') => (&text[..i], 60),
        (i, 'h') => (&text[..i], 3_600),
        (i, 'd') => (&text[..i], 86_400),
        _ => (text, 1),
    };
    let seconds = number.parse::<u64>().ok()?.checked_mul(scale)?;
    (1..=Unit::Year.seconds())
        .contains(&seconds)
        .then_some(seconds)
}

#[cfg(test)]
mod tests {
    use super::super::{RuleSet, load_str};
    use super::*;

    fn errors(text: &str) -> Vec<String> {
        match load_str("v.yaml", text) {
            Ok(_) => panic!("loaded without errors:\n{text}"),
            Err(errors) => errors.0.iter().map(ToString::to_string).collect(),
        }
    }

    fn one_rule(rate_limit: &str) -> Result<RuleSet, Vec<String>> {
        let text =
            format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      {rate_limit}\n");
        load_str("v.yaml", &text).map_err(|e| e.0.iter().map(ToString::to_string).collect())
    }

    fn limit_of(rate_limit: &str) -> Option<Limit> {
        let rules = one_rule(rate_limit).unwrap();
        let domain = rules.domain("d").unwrap();
        domain.lookup([("k", "x")]).unwrap().limit
    }

    #[test]
    fn empty_domain() {
        assert_eq!(
            errors("descriptors:\n  - key: k\n"),
            ["v.yaml:1:1: config file cannot have empty domain"]
        );
        assert_eq!(
            errors("domain: ''\n"),
            ["v.yaml:1:9: config file cannot have empty domain"]
        );
        assert_eq!(
            errors(""),
            ["v.yaml:1:1: config file cannot have empty domain"]
        );
        assert_eq!(
            errors("# nothing\n---\n"),
            ["v.yaml:1:1: config file cannot have empty domain"]
        );
    }

    #[test]
    fn on_backend_error_is_a_known_policy() {
        let rules = load_str("v.yaml", "domain: d\non_backend_error: local\n").unwrap();
        assert_eq!(
            rules.domain("d").unwrap().on_backend_error(),
            Some(FailurePolicy::Local)
        );
        assert_eq!(
            errors("domain: d\non_backend_error: open\n"),
            ["v.yaml:2:19: invalid on_backend_error 'open' (expected error, allow, deny or local)"]
        );
    }

    #[test]
    fn merged_domains_span_files_but_still_refuse_duplicates() {
        let dir = tempfile::tempdir().unwrap();
        let key = |k: &str, n: u32| {
            format!(
                "domain: d\ndescriptors:\n  - key: {k}\n    rate_limit: {{unit: minute, requests_per_unit: {n}}}\n"
            )
        };
        std::fs::write(dir.path().join("a.yaml"), key("key1", 10)).unwrap();
        std::fs::write(dir.path().join("b.yaml"), key("key2", 20)).unwrap();
        let merged = super::super::LoadOptions {
            merge_domains: true,
            ..Default::default()
        };
        let rules = super::super::load_with(dir.path(), merged).unwrap();
        let d = rules.domain("d").unwrap();
        let limit = |k| {
            d.lookup([(k, "x")])
                .unwrap()
                .limit
                .unwrap()
                .requests_per_unit
        };
        assert_eq!((limit("key1"), limit("key2")), (10, 20));
        let errors = super::super::load(dir.path()).unwrap_err().to_string();
        assert!(
            errors.ends_with("b.yaml:1:9: duplicate domain 'd' in config file"),
            "{errors}"
        );

        std::fs::write(dir.path().join("c.yaml"), key("key1", 30)).unwrap();
        let errors = super::super::load_with(dir.path(), merged)
            .unwrap_err()
            .to_string();
        assert!(
            errors.ends_with("c.yaml:3:5: duplicate descriptor composite key 'd.key1'"),
            "{errors}"
        );
    }

    #[test]
    fn custom_windows_and_several_limits_on_one_descriptor() {
        let rules = load_str(
            "v.yaml",
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      - {name: burst, unit: second, requests_per_unit: 10}\n      - {window: 30s, requests_per_unit: 100, algorithm: sliding_window}\n      - {unit: day, requests_per_unit: 1000, window: 2d}\n",
        )
        .unwrap();
        let rule = rules.domain("d").unwrap().lookup([("k", "x")]).unwrap();
        assert_eq!(rule.name.as_deref(), Some("burst"));
        assert_eq!(rule.limit.unwrap().window, 1);
        let also: Vec<(Unit, u64)> = rule.also.iter().map(|l| (l.unit, l.window)).collect();
        assert_eq!(also, [(Unit::Second, 30), (Unit::Day, 172_800)]);
        assert_eq!(parse_window("5m"), Some(300));
        assert_eq!(parse_window("90"), Some(90));
        assert_eq!(parse_window("0s"), None);
        assert_eq!(parse_window("366d"), None);
        assert_eq!(parse_window("5 minutes"), None);
        assert_eq!(
            errors(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {window: soon, requests_per_unit: 1}\n"
            ),
            [
                "v.yaml:4:26: invalid window 'soon' (expected a duration from 1s to 365d, such as 30s, 5m, 2h or 7d)"
            ]
        );
        assert_eq!(
            errors(
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      - {unlimited: true}\n      - {unit: second, requests_per_unit: 1, name: x}\n"
            ),
            [
                "v.yaml:6:9: unlimited cannot be combined with other limits",
                "v.yaml:6:9: name and replaces belong on the first limit of a rate_limit list",
            ]
        );
    }

    #[test]
    fn shards_are_bounded_by_the_limit() {
        let shards = |n: &str| {
            one_rule(&format!(
                "unit: second\n      requests_per_unit: 10\n      shards: {n}"
            ))
        };
        let rules = shards("4").unwrap();
        assert_eq!(
            rules
                .domain("d")
                .unwrap()
                .lookup([("k", "x")])
                .unwrap()
                .shards,
            4
        );
        assert_eq!(
            shards("11").unwrap_err(),
            [
                "v.yaml:7:15: shards must be from 1 to 10 (at most 64, and at most requests_per_unit), found 11"
            ]
        );
        assert!(shards("0").is_err());
    }

    #[test]
    fn leases_fit_the_limit_and_its_algorithm() {
        let lease = |body: &str| {
            one_rule(&format!(
                "unit: second\n      requests_per_unit: 10\n      {body}"
            ))
        };
        let rules = lease("lease: 5").unwrap();
        let rule = rules.domain("d").unwrap().lookup([("k", "x")]).unwrap();
        assert_eq!(rule.limit.unwrap().quota_lease, 5);
        assert_eq!(
            lease("lease: 11").unwrap_err(),
            ["v.yaml:7:14: lease must be from 1 to 10 (the limit, and the burst), found 11"]
        );
        assert_eq!(
            lease("algorithm: sliding_window\n      lease: 2").unwrap_err(),
            ["v.yaml:8:14: lease can only be used with algorithm fixed_window or token_bucket"]
        );
    }

    #[test]
    fn duplicate_domain() {
        assert_eq!(
            errors("domain: a\n---\ndomain: b\n---\ndomain: a\n"),
            ["v.yaml:5:9: duplicate domain 'a' in config file"]
        );
    }

    #[test]
    fn empty_key() {
        assert_eq!(
            errors(
                "domain: d\ndescriptors:\n  - value: v\n    rate_limit: {unit: second, requests_per_unit: 1}\n"
            ),
            ["v.yaml:3:5: descriptor has empty key"]
        );
    }

    #[test]
    fn duplicate_composite_key_names_the_full_path() {
        assert_eq!(
            errors(
                "domain: test-domain\n\
                 descriptors:\n  \
                   - key: key1\n    \
                     value: value1\n  \
                   - key: key1\n    \
                     value: value1\n"
            ),
            ["v.yaml:5:5: duplicate descriptor composite key 'test-domain.key1_value1'"]
        );
        assert_eq!(
            errors(
                "domain: d\n\
                 descriptors:\n  \
                   - key: a\n    \
                     descriptors:\n      \
                       - key: b\n      \
                       - key: b\n"
            ),
            ["v.yaml:6:9: duplicate descriptor composite key 'd.a.b'"]
        );
        // Judged by `key_value` text, as the reference does.
        assert_eq!(
            errors("domain: d\ndescriptors:\n  - key: a_b\n  - key: a\n    value: b\n"),
            ["v.yaml:4:5: duplicate descriptor composite key 'd.a_b'"]
        );
    }

    #[test]
    fn invalid_unit() {
        assert_eq!(
            one_rule("unit: foo").unwrap_err(),
            ["v.yaml:5:13: invalid rate limit unit 'foo'"]
        );
        assert_eq!(
            one_rule("requests_per_unit: 5").unwrap_err(),
            ["v.yaml:5:7: invalid rate limit unit ''"]
        );
        assert_eq!(
            one_rule("unit: unknown").unwrap_err(),
            ["v.yaml:5:13: invalid rate limit unit 'unknown'"]
        );
    }

    #[test]
    fn units_are_case_insensitive_and_include_week_month_year() {
        for (text, unit) in [
            ("SeCoNd", Unit::Second),
            ("week", Unit::Week),
            ("Month", Unit::Month),
            ("YEAR", Unit::Year),
        ] {
            let limit = limit_of(&format!("unit: {text}")).unwrap();
            assert_eq!(limit.unit, unit);
        }
    }

    #[test]
    fn unlimited() {
        assert_eq!(
            one_rule("unlimited: true\n      unit: day").unwrap_err(),
            ["v.yaml:6:13: should not specify rate limit unit when unlimited"]
        );
        // As in the reference: requests_per_unit and an invalid unit are tolerated.
        assert_eq!(
            limit_of("unlimited: true\n      requests_per_unit: 5"),
            None
        );
        assert_eq!(limit_of("unlimited: true\n      unit: bogus"), None);
        assert_eq!(
            one_rule("unlimited: true\n      algorithm: token_bucket\n      burst: 3").unwrap_err(),
            [
                "v.yaml:6:18: should not specify algorithm when unlimited",
                "v.yaml:7:14: should not specify burst when unlimited"
            ]
        );
    }

    #[test]
    fn replaces_entries() {
        assert_eq!(
            one_rule("unit: second\n      replaces:\n        - name:\n").unwrap_err(),
            ["v.yaml:7:11: should not have an empty replaces entry"]
        );
        assert_eq!(
            one_rule("unit: second\n      name: me\n      replaces:\n        - name: other\n        - name: me\n")
                .unwrap_err(),
            ["v.yaml:9:11: replaces should not contain name of same descriptor"]
        );
        let rules =
            one_rule("unit: second\n      name: me\n      replaces: [{name: a}, {name: b}]")
                .unwrap();
        let rule = rules.domain("d").unwrap().lookup([("k", "v")]).unwrap();
        assert_eq!(rule.name.as_deref(), Some("me"));
        assert_eq!(rule.replaces, ["a", "b"]);
    }

    #[test]
    fn missing_requests_per_unit_is_zero() {
        assert_eq!(
            limit_of("unit: minute"),
            Some(Limit::fixed(0, Unit::Minute))
        );
    }

    #[test]
    fn algorithm_defaults_to_fixed_window() {
        let limit = limit_of("unit: minute\n      requests_per_unit: 7").unwrap();
        assert_eq!(limit, Limit::fixed(7, Unit::Minute));
        assert_eq!(limit.algorithm, Algorithm::FixedWindow);
        let limit =
            limit_of("unit: minute\n      requests_per_unit: 7\n      algorithm: sliding_window")
                .unwrap();
        assert_eq!(limit.algorithm, Algorithm::SlidingWindow);
        assert_eq!(limit.burst, 7);
    }

    #[test]
    fn invalid_algorithm() {
        assert_eq!(
            one_rule("unit: second\n      algorithm: leaky_bucket").unwrap_err(),
            [
                "v.yaml:6:18: invalid algorithm 'leaky_bucket' (expected fixed_window, sliding_window, token_bucket or concurrency)"
            ]
        );
    }

    #[test]
    fn burst() {
        let limit = |extra: &str| {
            limit_of(&format!(
                "unit: second\n      requests_per_unit: 10\n      algorithm: token_bucket{extra}"
            ))
            .unwrap()
        };
        assert_eq!(limit("").burst, 10);
        assert_eq!(limit("\n      burst: 25").burst, 25);
        assert_eq!(limit("\n      burst: 25").algorithm, Algorithm::TokenBucket);
        assert_eq!(
            one_rule("unit: second\n      algorithm: token_bucket\n      burst: 0").unwrap_err(),
            ["v.yaml:7:14: burst must be at least 1"]
        );
        assert_eq!(
            one_rule("unit: second\n      burst: 5").unwrap_err(),
            ["v.yaml:6:14: burst can only be used with algorithm token_bucket"]
        );
        assert_eq!(
            one_rule("unit: second\n      algorithm: sliding_window\n      burst: 5").unwrap_err(),
            ["v.yaml:7:14: burst can only be used with algorithm token_bucket"]
        );
    }

    #[test]
    fn algorithms_whose_state_grows_with_the_limit_are_capped() {
        // (the rules with requests_per_unit {n}, the error at 10 001)
        let rows = [
            (
                "domain: d\ndescriptors:\n  - key: k\n    rate_limit: \
                 {unit: hour, algorithm: sliding_window, requests_per_unit: {n}}\n",
                "v.yaml:4:76: sliding_window keeps state per request it counts, so \
                 requests_per_unit must be at most 10000 (found 10001); use token_bucket for \
                 larger limits",
            ),
            (
                "domain: d\ndescriptors:\n  - key: k\n    descriptors:\n      - key: id\n        \
                 rate_limit: {unit: hour, algorithm: concurrency, requests_per_unit: {n}}\n",
                "v.yaml:6:77: concurrency keeps state per request it counts, so \
                 requests_per_unit must be at most 10000 (found 10001)",
            ),
        ];
        for (rules, error) in rows {
            let at = |n: u32| rules.replace("{n}", &n.to_string());
            assert!(load_str("v.yaml", &at(10_000)).is_ok(), "{}", at(10_000));
            assert_eq!(errors(&at(10_001)), [error]);
        }
        // The cap is theirs alone.
        let big =
            limit_of("unit: hour\n      algorithm: token_bucket\n      requests_per_unit: 1000000");
        assert_eq!(big.unwrap().requests_per_unit, 1_000_000);
    }

    #[test]
    fn every_error_is_collected_in_position_order() {
        let errors = errors(
            "domain: d\n\
             descriptors:\n  \
               - key: a\n    \
                 rate_limit: {unit: fortnight}\n  \
               - key: b\n    \
                 bogus: 1\n    \
                 rate_limit: {unit: second, requests_per_unit: lots}\n  \
               - value: v\n  \
               - key: a\n",
        );
        assert_eq!(
            errors,
            [
                "v.yaml:4:24: invalid rate limit unit 'fortnight'",
                "v.yaml:6:5: config error, unknown key 'bogus'",
                "v.yaml:7:51: invalid requests_per_unit 'lots' (expected an integer from 0 to 4294967295)",
                "v.yaml:8:5: descriptor has empty key",
                "v.yaml:9:5: duplicate descriptor composite key 'd.a'",
            ]
        );
    }
}
