//! `turnstile explain`: which rule a descriptor matches and, given a running instance, where
//! its counter stands now: the operator's answer to "why was this request limited?".
//!
//! The rules are loaded by the service's own loader and walked by its own matcher, so the
//! answer cannot drift from what `serve` does. The instance is asked with a `hits_addend`
//! of 0 on every descriptor, which reads without charging: explaining costs clients nothing.
//!
//! Exit status: 0 when every descriptor matches a rule (a limit or `unlimited`), 1 when one
//! matches none (an unknown domain included), 2 when there is no answer (bad arguments,
//! rules that do not load, an instance that cannot be asked).

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit as ProtoUnit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;

use crate::app::cli::ExplainArgs;
use crate::config::{DomainRules, Miss, Rule, RuleSet};
use crate::decision::limit::Limit;

/// How long the instance gets to answer, connection included.
const INSTANCE_TIMEOUT: Duration = Duration::from_secs(5);

/// One descriptor of the question: its entries, in order.
type Entries = Vec<(String, String)>;

/// Runs the command, printing the answer to stdout and problems to stderr.
pub fn main(args: &ExplainArgs) -> ExitCode {
    match explain(args) {
        Ok((text, all_matched)) => {
            print!("{text}");
            if all_matched {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            }
        }
        Err(error) => {
            eprintln!("turnstile explain: {error:#}");
            ExitCode::from(2)
        }
    }
}

/// The answer's text, and whether every descriptor matched a rule.
fn explain(args: &ExplainArgs) -> anyhow::Result<(String, bool)> {
    let descriptors = descriptors(args)?;
    let source = args.rules.source();
    let rules = source
        .load()
        .map_err(|errors| anyhow::anyhow!("the rules do not load:\n{errors}"))?;
    let statuses = match &args.instance {
        Some(instance) => Some(ask(instance, &args.domain, &descriptors)?),
        None => None,
    };

    let mut out = format!(
        "rules {} (version {})\n",
        source.path.display(),
        short(rules.version())
    );
    let domain = rules.domain(&args.domain);
    match domain {
        Some(domain) => {
            let _ = write!(
                out,
                "domain {}: {} rules",
                domain.name(),
                domain.rule_count()
            );
            if let Some(policy) = domain.on_backend_error() {
                let _ = write!(out, ", on_backend_error {policy}");
            }
            out.push('\n');
        }
        None => {
            let _ = writeln!(
                out,
                "domain {}: no rules (loaded domains: {}); nothing in it is ever limited",
                args.domain,
                known_domains(&rules)
            );
        }
    }

    let mut all_matched = true;
    for (i, entries) in descriptors.iter().enumerate() {
        let _ = writeln!(out, "\ndescriptor {} {}", i + 1, show(entries));
        let found = domain.map(|d| d.walk(entries.iter().map(|(k, v)| (k.as_str(), v.as_str()))));
        match found {
            Some(Ok(rule)) => describe(&mut out, rule),
            Some(Err(miss)) => {
                all_matched = false;
                let _ = writeln!(out, "  no rule matches: {}", why(miss, entries));
            }
            None => {
                all_matched = false;
                let _ = writeln!(out, "  no rule matches: the domain has no rules");
            }
        }
        if let Some(statuses) = &statuses {
            let _ = writeln!(out, "  now          {}", now(statuses.get(i)));
        }
    }
    Ok((out, all_matched))
}

/// The descriptors asked about: every `--descriptor`, then the positional entries.
fn descriptors(args: &ExplainArgs) -> anyhow::Result<Vec<Entries>> {
    let mut all = Vec::new();
    for text in &args.descriptors {
        all.push(text.split(',').map(entry).collect::<anyhow::Result<_>>()?);
    }
    if !args.entries.is_empty() {
        all.push(
            args.entries
                .iter()
                .map(|e| entry(e))
                .collect::<anyhow::Result<_>>()?,
        );
    }
    anyhow::ensure!(
        !all.is_empty(),
        "no descriptor: give its entries as KEY=VALUE arguments, or --descriptor KEY=VALUE,..."
    );
    Ok(all)
}

fn entry(text: &str) -> anyhow::Result<(String, String)> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => anyhow::bail!("'{text}' is not an entry: expected KEY=VALUE with a non-empty KEY"),
    }
}

fn show(entries: &Entries) -> String {
    let shown: Vec<String> = entries.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("[{}]", shown.join(", "))
}

fn short(version: &str) -> &str {
    version.get(..12).unwrap_or(version)
}

fn known_domains(rules: &RuleSet) -> String {
    let names: Vec<&str> = rules.domains().map(DomainRules::name).collect();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

/// The matched rule, a field a line.
fn describe(out: &mut String, rule: &Rule) {
    let _ = writeln!(out, "  rule         {}", rule.full_key);
    if let Some(name) = &rule.name {
        let _ = writeln!(out, "  name         {name}");
    }
    match &rule.limit {
        None => {
            let _ = writeln!(out, "  limit        unlimited (never refused)");
        }
        Some(limit) => {
            let _ = writeln!(out, "  limit        {}", limit_text(limit));
            for also in &rule.also {
                let _ = writeln!(out, "  also         {}", limit_text(also));
            }
        }
    }
    let _ = writeln!(
        out,
        "  shadow_mode  {}",
        if rule.shadow_mode {
            "yes: counted and reported, never refuses"
        } else {
            "no"
        }
    );
    let _ = writeln!(
        out,
        "  quota_mode   {}",
        if rule.quota_mode {
            "yes: refuses only when every quota limit of the request is over"
        } else {
            "no"
        }
    );
    if rule.shards > 1 {
        let _ = writeln!(
            out,
            "  shards       {} (each request counts on one, with its share of the limit)",
            rule.shards
        );
    }
    for (level, pattern) in rule.shared.iter().enumerate() {
        if let Some(pattern) = pattern {
            let _ = writeln!(
                out,
                "  shared       entry {}: every value matching '{pattern}' counts on one counter",
                level + 1
            );
        }
    }
    if !rule.replaces.is_empty() {
        let _ = writeln!(
            out,
            "  replaces     {} (dropped when matched in the same request)",
            rule.replaces.join(", ")
        );
    }
}

fn limit_text(limit: &Limit) -> String {
    if limit.algorithm.in_flight() {
        return format!(
            "{} in flight, concurrency, a permit held at most {}s",
            limit.requests_per_unit, limit.window
        );
    }
    let mut text = format!(
        "{} per {}, {}",
        limit.requests_per_unit, limit.unit, limit.algorithm
    );
    if limit.window != limit.unit.seconds() {
        let _ = write!(text, ", window {}s", limit.window);
    }
    if limit.algorithm.takes_burst() {
        let _ = write!(text, ", burst {}", limit.burst);
    }
    if limit.quota_lease > 1 {
        let _ = write!(text, ", lease {}", limit.quota_lease);
    }
    text
}

/// Why the walk found no rule, in the operator's terms.
fn why(miss: Miss, entries: &Entries) -> String {
    let at = |entry: usize| {
        let (key, value) = &entries[entry];
        format!("entry {} ({key}={value})", entry + 1)
    };
    match miss {
        Miss::Empty => "the descriptor has no entries".to_owned(),
        Miss::NoKey { entry } => format!(
            "{}: no rule at this depth has the key '{}' (keys are case-sensitive)",
            at(entry),
            entries[entry].0
        ),
        Miss::NoValue { entry } => format!(
            "{}: rules have this key, but no value of theirs, wildcard or key-only default \
             matches '{}'",
            at(entry),
            entries[entry].1
        ),
        Miss::PastTheEnd { entry } => format!(
            "{}: the rules' path ends before it, and a descriptor longer than every rule's \
             path gets no limit",
            at(entry)
        ),
        Miss::NoLimitHere => "every entry matches, but the node they reach has no rate_limit \
                              (its limits are on longer descriptors)"
            .to_owned(),
    }
}

/// The instance's answer on one descriptor.
fn now(status: Option<&DescriptorStatus>) -> String {
    let Some(status) = status else {
        return "the instance sent no status for it".to_owned();
    };
    let code = Code::try_from(status.code).map_or("UNKNOWN", |c| c.as_str_name());
    let Some(limit) = &status.current_limit else {
        return format!("{code}, no limit applies on the instance");
    };
    let unit = ProtoUnit::try_from(limit.unit).map_or("UNKNOWN", |u| u.as_str_name());
    let mut text = format!(
        "remaining {} of {} per {unit}",
        status.limit_remaining, limit.requests_per_unit
    );
    if status.code != Code::Ok as i32 {
        text = format!("{code}, {text}");
    }
    if let Some(reset) = &status.duration_until_reset {
        let reset = Duration::new(
            u64::try_from(reset.seconds).unwrap_or(0),
            u32::try_from(reset.nanos).unwrap_or(0),
        );
        let _ = write!(text, ", resets in {}", humantime::format_duration(reset));
    }
    if status.limit_remaining == 0 {
        text += ": the next hit is over the limit";
    }
    text
}

/// One read-only call to the instance: every descriptor with `hits_addend` 0.
fn ask(
    instance: &str,
    domain: &str,
    descriptors: &[Entries],
) -> anyhow::Result<Vec<DescriptorStatus>> {
    let uri = if instance.contains("://") {
        instance.to_owned()
    } else {
        format!("http://{instance}")
    };
    let request = RateLimitRequest {
        domain: domain.to_owned(),
        descriptors: descriptors
            .iter()
            .map(|entries| RateLimitDescriptor {
                entries: entries
                    .iter()
                    .map(|(key, value)| Entry {
                        key: key.clone(),
                        value: value.clone(),
                    })
                    .collect(),
                hits_addend: Some(UInt64Value { value: 0 }),
                ..Default::default()
            })
            .collect(),
        hits_addend: 0,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let response: RateLimitResponse = runtime
        .block_on(async {
            let call = async {
                let channel = tonic::transport::Endpoint::from_shared(uri.clone())?
                    .connect()
                    .await?;
                let response = RateLimitServiceClient::new(channel)
                    .should_rate_limit(request)
                    .await?;
                anyhow::Ok(response.into_inner())
            };
            tokio::time::timeout(INSTANCE_TIMEOUT, call)
                .await
                .map_err(|_| anyhow::anyhow!("no answer within {INSTANCE_TIMEOUT:?}"))?
        })
        .map_err(|e| anyhow::anyhow!("cannot ask the instance at {uri}: {e:#}"))?;
    Ok(response.statuses)
}
