//! The matching step: what each descriptor of a request asks of the backend.
//!
//! Every descriptor becomes a `Decision`: no limit, unlimited, or a hit on a limit. Hits go
//! to the backend in one batch; `replaces` is applied across the whole request first, so a
//! replaced rule is never counted. Two descriptors that name the same state are two hits, in
//! request order: the backend judges each seeing the charge of the one before it, as the
//! reference counts (limit 3: remaining 2, then 1).

use std::collections::HashSet;

use crate::config::{DomainRules, Rule, RuleSet};
use crate::decision::FailurePolicy;
use crate::decision::key::{Shard, limit_key};
use crate::decision::limit::Limit;
use crate::decision::{Hit, Outcome, PermitOp, Role};
use crate::ops::metrics::StatsKey;
use crate::service::request::{CheckRequest, Descriptor};

/// The rule (or request override) that governs a descriptor.
#[derive(Debug, Clone, PartialEq)]
pub struct Applied<'a> {
    /// `current_limit.name` in the answer: the rule's YAML `name`, or empty, as the reference
    /// answers (Envoy copies it into the client-visible `X-RateLimit-Limit`).
    pub name: &'a str,
    /// Which rule decided, for the private places (dynamic metadata, logs): the rule's `name`,
    /// else its descriptor path, or "override" for a request-supplied limit.
    pub rule: &'a str,
    /// The stats key its counters are filed under.
    pub stats_key: StatsKey<'a>,
    pub role: Role,
    /// Index of its hit in `Plan::hits`.
    pub hit: usize,
    /// Hits of the rule's further limits (a `rate_limit` list), all enforced with `hit`.
    pub also: Vec<usize>,
    /// This descriptor's cost.
    pub cost: u64,
    /// The rule's `metadata`, for the reference's response metadata.
    pub metadata: Option<&'a serde_json::Value>,
}

impl Applied<'_> {
    /// Every hit of this descriptor.
    pub fn hits(&self) -> impl Iterator<Item = usize> + '_ {
        std::iter::once(self.hit).chain(self.also.iter().copied())
    }

    /// The hit that speaks for the descriptor: of its refused limits the one that refuses
    /// longest (when the request could pass), else the one with the fewest left.
    pub fn decisive(&self, outcomes: &[Outcome]) -> usize {
        self.hits()
            .max_by_key(|&i| {
                let o = &outcomes[i];
                (
                    !o.admitted,
                    o.admitted.then(|| u32::MAX - o.remaining),
                    o.reset_after,
                )
            })
            .unwrap_or(self.hit)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Decision<'a> {
    /// No rule matched (or the domain is unknown, or the rule was replaced).
    NoLimit,
    Unlimited,
    Limited(Applied<'a>),
}

#[derive(Debug, Default)]
pub struct Plan<'a> {
    pub decisions: Vec<Decision<'a>>,
    pub hits: Vec<Hit>,
    /// The request named a domain no rules define.
    pub unknown_domain: bool,
    /// The domain's own failure policy, when its rules set one.
    pub on_backend_error: Option<FailurePolicy>,
}

/// A concurrency limit's permit: named by the descriptor's last entry (the request), given
/// back on negative hits, taken otherwise (unless the call only reads).
fn permit(descriptor: &Descriptor<'_>, limit: &Limit) -> Option<(PermitOp, String)> {
    if !limit.algorithm.in_flight() {
        return None;
    }
    let (_, id) = descriptor.entries.last()?;
    let op = match (descriptor.release, descriptor.hits) {
        (true, _) => PermitOp::Release,
        (false, 0) => return None,
        (false, _) => PermitOp::Acquire,
    };
    Some((op, (*id).to_owned()))
}

/// Shard `shard` of `shards` of `limit`: the limit and burst divided so the shards add up
/// exactly to the whole (the first `n % shards` get one more).
fn shard_of(limit: Limit, Shard(shard): Shard, shards: u32) -> Limit {
    let share = |n: u32| n / shards + u32::from(shard < n % shards);
    Limit {
        requests_per_unit: share(limit.requests_per_unit),
        burst: share(limit.burst).max(1),
        ..limit
    }
}

/// The descriptor's entries, with a rule's `share_threshold` patterns in place of the values
/// they match (so every matching value counts on one counter).
fn entries<'e>(
    descriptor: &'e Descriptor<'_>,
    shared: &'e [Option<String>],
) -> impl Iterator<Item = (&'e str, &'e str)> {
    shared_entries(&descriptor.entries, shared)
}

/// `entries` in the rule's order, with the rule's `share_threshold` patterns in place of the
/// values they match (RLQS buckets name their state this way too).
pub fn shared_entries<'e>(
    entries: &'e [(&'e str, &'e str)],
    shared: &'e [Option<String>],
) -> impl Iterator<Item = (&'e str, &'e str)> {
    entries.iter().enumerate().map(|(i, &(k, v))| {
        let shared = shared.get(i).and_then(Option::as_deref);
        (k, shared.unwrap_or(v))
    })
}

/// `<domain>.<key>_<value>.…` from the request's own values: the stats key of detailed
/// metrics and of overrides.
fn detailed_stats_key(
    domain: &str,
    descriptor: &Descriptor<'_>,
    shared: &[Option<String>],
) -> String {
    let mut key = domain.to_owned();
    for (k, v) in entries(descriptor, shared) {
        key.push('.');
        key.push_str(k);
        key.push('_');
        key.push_str(v);
    }
    key
}

impl<'a> Plan<'a> {
    pub fn build(rules: &'a RuleSet, request: &CheckRequest<'_>) -> Plan<'a> {
        let Some(domain) = rules.domain(request.domain) else {
            return Plan {
                decisions: vec![Decision::NoLimit; request.descriptors.len()],
                hits: Vec::new(),
                unknown_domain: true,
                on_backend_error: None,
            };
        };
        let matched: Vec<Option<&Rule>> = request
            .descriptors
            .iter()
            .map(|d| match d.limit_override {
                Some(_) => None,
                None => domain.lookup(d.entries.iter().copied()),
            })
            .collect();
        let replaced: HashSet<&str> = matched
            .iter()
            .flatten()
            .flat_map(|rule| rule.replaces.iter().map(String::as_str))
            .collect();

        // Sized up front: growing from empty reallocates on the first push of each.
        let mut plan = Plan {
            decisions: Vec::with_capacity(request.descriptors.len()),
            hits: Vec::with_capacity(request.descriptors.len()),
            on_backend_error: domain.on_backend_error(),
            ..Plan::default()
        };
        for (descriptor, rule) in request.descriptors.iter().zip(matched) {
            let decision = plan.decide(domain, descriptor, rule, &replaced);
            plan.decisions.push(decision);
        }
        plan
    }

    /// The limit and outcome that speak for a limited descriptor (see `Applied::decisive`).
    pub fn decisive<'o>(
        &self,
        applied: &Applied<'_>,
        outcomes: &'o [Outcome],
    ) -> (&Limit, &'o Outcome) {
        let i = applied.decisive(outcomes);
        (&self.hits[i].limit, &outcomes[i])
    }

    /// Global quota mode (the reference's QUOTA_MODE): every enforced limit becomes a soft
    /// one, so the request is refused only when all of them are over.
    pub fn into_quota_mode(mut self) -> Plan<'a> {
        for hit in &mut self.hits {
            if hit.role == Role::Enforce {
                hit.role = Role::Quota;
            }
        }
        for decision in &mut self.decisions {
            if let Decision::Limited(applied) = decision
                && applied.role == Role::Enforce
            {
                applied.role = Role::Quota;
            }
        }
        self
    }

    fn decide(
        &mut self,
        domain: &'a DomainRules,
        descriptor: &Descriptor<'_>,
        rule: Option<&'a Rule>,
        replaced: &HashSet<&str>,
    ) -> Decision<'a> {
        let metadata = rule.and_then(|r| r.metadata.as_ref());
        let (limit, also, shared, shards, applied) = match (descriptor.limit_override, rule) {
            (Some(o), _) => {
                let limit = Limit::fixed(o.requests_per_unit, o.unit);
                let stats_key =
                    StatsKey::Request(detailed_stats_key(domain.name(), descriptor, &[]));
                let applied = ("", "override", stats_key, Role::Enforce);
                (limit, &[][..], &[][..], 1, applied)
            }
            (None, None) => return Decision::NoLimit,
            (None, Some(rule)) => {
                if rule.name.as_deref().is_some_and(|n| replaced.contains(n)) {
                    return Decision::NoLimit;
                }
                let Some(limit) = rule.limit else {
                    return Decision::Unlimited;
                };
                let stats_key = if rule.detailed_metric {
                    StatsKey::Request(detailed_stats_key(domain.name(), descriptor, &rule.shared))
                } else {
                    StatsKey::Rule(rule.full_key.as_str())
                };
                let role = if rule.shadow_mode {
                    Role::Shadow
                } else if rule.quota_mode {
                    Role::Quota
                } else {
                    Role::Enforce
                };
                let name = rule.name.as_deref().unwrap_or_default();
                let attribution = rule.name.as_deref().unwrap_or(&rule.full_key);
                (
                    limit,
                    rule.also.as_slice(),
                    rule.shared.as_slice(),
                    rule.shards,
                    (name, attribution, stats_key, role),
                )
            }
        };
        let (name, attribution, stats_key, role) = applied;
        // A limit split over shards: this request lands on one of them, at random, and is
        // judged against that shard's share.
        let shard = (shards > 1).then(|| Shard(fastrand::u32(..shards)));
        let place = |limit: Limit| match shard {
            Some(shard) => (shard_of(limit, shard, shards), Some(shard)),
            None => (limit, None),
        };
        let (limit, at) = place(limit);
        let hit = self.hit(domain, descriptor, shared, limit, at, role);
        let also = also
            .iter()
            .map(|&limit| {
                let (limit, at) = place(limit);
                self.hit(domain, descriptor, shared, limit, at, role)
            })
            .collect();
        Decision::Limited(Applied {
            name,
            rule: attribution,
            stats_key,
            role,
            hit,
            also,
            cost: descriptor.hits,
            metadata: metadata.filter(|_| descriptor.limit_override.is_none()),
        })
    }

    /// The index of the new hit of `descriptor` on `limit`.
    fn hit(
        &mut self,
        domain: &DomainRules,
        descriptor: &Descriptor<'_>,
        shared: &[Option<String>],
        limit: Limit,
        shard: Option<Shard>,
        role: Role,
    ) -> usize {
        let key = limit_key(domain.name(), entries(descriptor, shared), &limit, shard);
        self.hits.push(Hit {
            key,
            limit,
            units: descriptor.hits,
            role,
            permit: permit(descriptor, &limit),
        });
        self.hits.len() - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::limit::Unit;

    #[test]
    fn shards_add_up_to_the_whole_limit() {
        let limit = Limit::fixed(10, Unit::Second);
        let shares: Vec<u32> = (0..4)
            .map(|s| shard_of(limit, Shard(s), 4).requests_per_unit)
            .collect();
        assert_eq!(shares, [3, 3, 2, 2]);
        assert_eq!(shares.iter().sum::<u32>(), 10);
    }
}
