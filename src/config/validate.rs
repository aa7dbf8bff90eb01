//! The validate step: the rule model → compiled domains, with the reference's error texts.
//!
//! Every check runs even after one fails, so a load reports all problems at once; the compiled
//! result is only used when there were none.

use std::collections::{BTreeMap, HashSet};

use super::ConfigError;
use super::matcher::{DomainRules, Level, Rule, Step};
use super::model::{DescriptorSpec, DomainSpec, RateLimitSpec};
use super::yaml::Pos;
use crate::limit::{Algorithm, Limit, Unit};

/// A sliding window keeps one entry per admitted request, so its limit is capped to bound the
/// state one key can hold.
pub const SLIDING_WINDOW_MAX_LIMIT: u32 = 10_000;

/// Accumulates domains across documents and files, rejecting duplicates.
#[derive(Default)]
pub struct Validator {
    domains: BTreeMap<String, DomainRules>,
}

impl Validator {
    pub fn add(&mut self, file: &str, spec: &DomainSpec, errors: &mut Vec<ConfigError>) {
        let mut check = Check { file, errors };
        let mut rules = Vec::new();
        let root = check.level(&spec.domain, &spec.descriptors, &mut rules);
        if spec.domain.is_empty() {
            check.error(spec.pos, "config file cannot have empty domain".to_owned());
        } else if self.domains.contains_key(&spec.domain) {
            check.error(
                spec.pos,
                format!("duplicate domain '{}' in config file", spec.domain),
            );
        } else {
            self.domains.insert(
                spec.domain.clone(),
                DomainRules::new(spec.domain.clone(), root, rules),
            );
        }
    }

    pub fn finish(self) -> BTreeMap<String, DomainRules> {
        self.domains
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

    /// Compiles one level; `parent` is the full key of the node that owns it.
    fn level(&mut self, parent: &str, specs: &[DescriptorSpec], rules: &mut Vec<Rule>) -> Level {
        let mut level = Level::default();
        // The reference keys a level by `key` or `key_value`; duplicates are judged the same way.
        let mut seen = HashSet::new();
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
            let rule = spec.rate_limit.as_ref().map(|rate_limit| {
                rules.push(self.rule(spec, rate_limit, full_key.clone()));
                rules.len() - 1
            });
            let children = self.level(&full_key, &spec.descriptors, rules);
            level.insert(&spec.key, spec.value.as_deref(), Step::new(rule, children));
        }
        level
    }

    fn rule(
        &mut self,
        spec: &DescriptorSpec,
        rate_limit: &RateLimitSpec,
        full_key: String,
    ) -> Rule {
        let limit = if rate_limit.unlimited {
            self.unlimited(rate_limit);
            None
        } else {
            self.limit(rate_limit)
        };
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
        let unit = match &rate_limit.unit {
            Some(unit) => Unit::parse(&unit.value).ok_or((unit.pos, unit.value.as_str())),
            None => Err((rate_limit.pos, "")),
        };
        let unit = unit
            .map_err(|(pos, text)| self.error(pos, format!("invalid rate limit unit '{text}'")))
            .ok();

        let algorithm = match &rate_limit.algorithm {
            None => Some(Algorithm::default()),
            Some(name) => {
                let algorithm = Algorithm::parse(&name.value);
                if algorithm.is_none() {
                    self.error(
                        name.pos,
                        format!(
                            "invalid algorithm '{}' (expected fixed_window, sliding_window or token_bucket)",
                            name.value
                        ),
                    );
                }
                algorithm
            }
        };

        // Missing means 0, as in the reference: every request is over the limit.
        let requests_per_unit = rate_limit.requests_per_unit.as_ref().map_or(0, |r| r.value);
        if algorithm == Some(Algorithm::SlidingWindow)
            && requests_per_unit > SLIDING_WINDOW_MAX_LIMIT
        {
            let pos = rate_limit
                .requests_per_unit
                .as_ref()
                .map_or(rate_limit.pos, |r| r.pos);
            self.error(
                pos,
                format!(
                    "sliding_window keeps one entry per admitted request, so requests_per_unit \
                     must be at most {SLIDING_WINDOW_MAX_LIMIT} (found {requests_per_unit}); \
                     use token_bucket for larger limits"
                ),
            );
        }

        let burst = match &rate_limit.burst {
            None => requests_per_unit,
            Some(burst) => {
                if algorithm.is_some_and(|a| a != Algorithm::TokenBucket) {
                    self.error(
                        burst.pos,
                        "burst can only be used with algorithm token_bucket".to_owned(),
                    );
                } else if burst.value == 0 {
                    self.error(burst.pos, "burst must be at least 1".to_owned());
                }
                burst.value
            }
        };

        Some(Limit {
            requests_per_unit,
            unit: unit?,
            algorithm: algorithm?,
            burst,
        })
    }
}
