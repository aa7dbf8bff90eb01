//! The system, not each node, is right: several turnstile instances (the real binary) sharing
//! one Redis, or a 3-master Redis Cluster, under many concurrent gRPC streams spread over all
//! of them, admit what one limit allows, no more, and under excess demand no less. The memory
//! backend shows why Redis is needed (each instance admits the whole limit), and an instance
//! killed with SIGKILL comes back to the counts Redis kept.
//!
//! Each test prints its measured figures (`cargo test --test system -- --nocapture`).

mod support;

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use support::clock::{HOUR, clear_of_end};
use support::load::{self, Answer, Load, Sample, Spec, Target};
use support::redis::{RedisCluster, RedisServer};
use support::turnstile::{Rules, Turnstile, descriptor, request};

const INSTANCES: usize = 4;
/// Concurrent gRPC streams, spread round-robin over the instances.
const STREAMS: usize = 64;
/// Channels (HTTP/2 connections) per instance that the streams share.
const CHANNELS_PER_INSTANCE: usize = 2;

/// Fixed window: per hour, so a whole run sits in one window and the count must be exact.
const FIXED_LIMIT: u32 = 300;
/// Sliding window: per second, so a run spans several windows.
const SLIDING_LIMIT: u32 = 200;
const SLIDING_WINDOW: Duration = Duration::from_secs(1);
/// Token bucket: this many per second after a burst of `BUCKET_BURST`.
const BUCKET_RATE: u32 = 200;
const BUCKET_BURST: u32 = 100;
/// How long the sliding-window and token-bucket loads run.
const TIMED_RUN: Duration = Duration::from_millis(2_500);

/// Redis keeps time with the wall clock, the test with the monotonic one; they may drift apart
/// by up to 500 ppm under NTP slewing. Time bounds are checked with this much in Redis' favour.
const CLOCK_SLACK: Duration = Duration::from_millis(2);
/// Under excess demand, at least this share of what the limit allows must be admitted.
const MIN_SHARE: f64 = 0.99;

const RULES: &str = r#"
domain: system
descriptors:
  - key: fixed
    rate_limit: {unit: hour, requests_per_unit: 300}
  - key: sliding
    rate_limit: {unit: second, requests_per_unit: 200, algorithm: sliding_window}
  - key: bucket
    rate_limit: {unit: second, requests_per_unit: 200, algorithm: token_bucket, burst: 100}
  - key: long_fixed
    rate_limit: {unit: hour, requests_per_unit: 100000}
  - key: long_sliding
    rate_limit: {unit: hour, requests_per_unit: 10000, algorithm: sliding_window}
  - key: long_bucket
    rate_limit: {unit: hour, requests_per_unit: 10000, algorithm: token_bucket}
"#;

// ---- helpers -------------------------------------------------------------------------------

/// Generous Redis and call bounds: a busy 2-core machine must not turn into errors.
fn redis_args(url: &str, redis_type: &str) -> Vec<String> {
    [
        "--backend",
        "redis",
        "--redis-url",
        url,
        "--redis-type",
        redis_type,
        "--redis-timeout",
        "2s",
        "--redis-connect-timeout",
        "2s",
        "--request-timeout",
        "5s",
    ]
    .map(String::from)
    .to_vec()
}

async fn fleet(rules: &Rules, args: Vec<String>) -> Vec<Turnstile> {
    Turnstile::start_all(rules.path(), &vec![args; INSTANCES]).await
}

/// Targets such that stream `i` talks to instance `i % instances.len()` (the target's id).
async fn targets(instances: &[Turnstile], request: &RateLimitRequest) -> Vec<Target> {
    let mut targets = Vec::new();
    for _ in 0..CHANNELS_PER_INSTANCE {
        for (id, t) in instances.iter().enumerate() {
            targets.push(Target {
                id,
                channel: t.channel().await,
                request: request.clone(),
            });
        }
    }
    targets
}

fn one(key: &str, value: &str) -> RateLimitRequest {
    request("system", vec![descriptor(&[(key, value)])])
}

fn errors(samples: &[Sample]) -> Vec<&Sample> {
    samples.iter().filter(|s| s.answer.failed()).collect()
}

fn admissions(samples: &[Sample]) -> Vec<(Instant, Instant)> {
    samples
        .iter()
        .filter(|s| s.answer.admitted())
        .map(|s| (s.sent, s.answered))
        .collect()
}

fn assert_no_errors(samples: &[Sample], what: &str) {
    let failed = errors(samples);
    assert!(
        failed.is_empty(),
        "{what}: {} of {} calls failed, e.g. {:?}",
        failed.len(),
        samples.len(),
        failed.first().map(|s| &s.answer)
    );
}

fn calls_per_second(samples: &[Sample]) -> f64 {
    match (samples.first(), samples.last()) {
        (Some(first), Some(last)) if last.answered > first.sent => {
            samples.len() as f64 / (last.answered - first.sent).as_secs_f64()
        }
        _ => 0.0,
    }
}

// ---- the three algorithms on a shared backend ------------------------------------------------

/// Fixed window, one hourly window, demand 3L: exactly L admitted, and every admission got a
/// distinct `limit_remaining` (L-1 down to 0), which only one shared, atomic count gives.
async fn fixed_window(instances: &[Turnstile], topology: &str) -> f64 {
    clear_of_end(HOUR, Duration::from_secs(20)).await;
    let limit = FIXED_LIMIT as usize;
    let mut spec = Spec::new(targets(instances, &one("fixed", topology)).await, STREAMS);
    spec.max_calls = 3 * limit;
    spec.max_time = Duration::from_secs(20);
    let samples = Load::start(spec).finish().await;
    let what = format!("{topology} fixed_window");
    assert_no_errors(&samples, &what);
    assert_eq!(samples.len(), 3 * limit, "{what}: every call answered");
    let mut remaining: Vec<u32> = samples
        .iter()
        .filter(|s| s.answer.admitted())
        .map(|s| s.answer.remaining().expect("a status"))
        .collect();
    let admitted = remaining.len();
    remaining.sort_unstable();
    assert_eq!(
        admitted, limit,
        "{what}: {admitted} admitted by {INSTANCES} instances for a limit of {limit} in one window"
    );
    assert_eq!(
        remaining,
        (0..FIXED_LIMIT).collect::<Vec<_>>(),
        "{what}: each admission saw its own count"
    );
    for (id, _) in instances.iter().enumerate() {
        assert!(
            samples
                .iter()
                .any(|s| s.target == id && s.answer.admitted()),
            "{what}: instance {id} admitted nothing: the load did not reach every instance"
        );
    }
    let ratio = admitted as f64 / limit as f64;
    println!(
        "[system] {topology:<7} fixed_window   L={limit}/hour  calls={} ({:.0}/s) admitted={admitted} errors=0  max admitted/limit = {ratio:.3}",
        samples.len(),
        calls_per_second(&samples),
    );
    ratio
}

/// Sliding window of one second for a timed run at excess demand: no interval shorter than a
/// window is known to hold more than L admissions, and every refusal is justified: at least L
/// admissions may have been in the window it was decided in (none is, under-admission).
async fn sliding_window(instances: &[Turnstile], topology: &str) -> f64 {
    let limit = f64::from(SLIDING_LIMIT);
    let mut spec = Spec::new(targets(instances, &one("sliding", topology)).await, STREAMS);
    spec.max_time = TIMED_RUN;
    let samples = Load::start(spec).finish().await;
    let what = format!("{topology} sliding_window");
    assert_no_errors(&samples, &what);
    let admitted = admissions(&samples);
    let (ratio, most, span) = load::max_ratio(&admitted, |span| {
        (span + CLOCK_SLACK < SLIDING_WINDOW).then_some(limit)
    });
    assert!(
        ratio <= 1.0,
        "{what}: {most} admissions within {span:?}, more than {limit} in one window"
    );
    let run = samples.last().unwrap().sent - samples.first().unwrap().sent;
    assert!(
        run >= 2 * SLIDING_WINDOW,
        "{what}: the run was too short ({run:?})"
    );
    // A refusal decided at t in [sent, answered] saw the admissions of (t - W, t]; the ones
    // that may have been there are those answered after sent - W and sent before answered.
    let mut least_justified = usize::MAX;
    for refused in samples.iter().filter(|s| !s.answer.admitted()) {
        let possible = admitted
            .iter()
            .filter(|&&(sent, answered)| {
                answered + SLIDING_WINDOW + CLOCK_SLACK > refused.sent && sent <= refused.answered
            })
            .count();
        least_justified = least_justified.min(possible);
        assert!(
            possible >= SLIDING_LIMIT as usize,
            "{what}: refused at +{:?} with at most {possible} admissions in its window: under-admission",
            refused.sent - samples[0].sent
        );
    }
    let per_window = admitted.len() as f64 / run.as_secs_f64().ceil();
    assert!(
        per_window >= MIN_SHARE * limit,
        "{what}: {} admitted in {run:?}: under-admission",
        admitted.len()
    );
    assert!(
        samples.len() >= 2 * admitted.len(),
        "{what}: demand ({} calls) was not in excess of the limit ({} admitted)",
        samples.len(),
        admitted.len()
    );
    println!(
        "[system] {topology:<7} sliding_window L={limit}/s     calls={} ({:.0}/s) admitted={} in {run:.2?} errors=0  max admitted/limit in any 1 s = {ratio:.3} ({most} within {span:.1?}); every refusal had >= {least_justified} possible admissions in its window",
        samples.len(),
        calls_per_second(&samples),
        admitted.len(),
    );
    ratio
}

/// Token bucket at excess demand: no interval is known to hold more than burst + rate × its
/// length, and at least 0.99 of what the bucket allows over the run was admitted.
async fn token_bucket(instances: &[Turnstile], topology: &str) -> f64 {
    let (rate, burst) = (f64::from(BUCKET_RATE), f64::from(BUCKET_BURST));
    let allowed = |span: Duration| burst + rate * span.as_secs_f64();
    let mut spec = Spec::new(targets(instances, &one("bucket", topology)).await, STREAMS);
    spec.max_time = TIMED_RUN;
    let samples = Load::start(spec).finish().await;
    let what = format!("{topology} token_bucket");
    assert_no_errors(&samples, &what);
    let admitted = admissions(&samples);
    let (ratio, most, span) = load::max_ratio(&admitted, |span| Some(allowed(span + CLOCK_SLACK)));
    assert!(
        ratio <= 1.0,
        "{what}: {most} admissions within {span:?}, more than burst {burst} + {rate}/s"
    );
    let first_admitted = admitted
        .iter()
        .map(|&(_, answered)| answered)
        .min()
        .unwrap();
    let last_sent = samples.last().unwrap().sent;
    let floor = allowed(last_sent.saturating_duration_since(first_admitted));
    assert!(
        admitted.len() as f64 >= MIN_SHARE * floor,
        "{what}: only {} admitted where the bucket allowed {floor:.0}: under-admission",
        admitted.len()
    );
    assert!(
        samples.len() >= 2 * admitted.len(),
        "{what}: demand ({} calls) was not in excess of the limit ({} admitted)",
        samples.len(),
        admitted.len()
    );
    println!(
        "[system] {topology:<7} token_bucket   {rate}/s burst {burst} calls={} ({:.0}/s) admitted={} errors=0  max admitted/(burst + rate × span) = {ratio:.3} ({most} within {span:.1?})",
        samples.len(),
        calls_per_second(&samples),
        admitted.len(),
    );
    ratio
}

async fn every_algorithm(instances: &[Turnstile], topology: &str) {
    let fixed = fixed_window(instances, topology).await;
    let sliding = sliding_window(instances, topology).await;
    let bucket = token_bucket(instances, topology).await;
    println!(
        "[system] {topology:<7} max admitted/limit: fixed_window {fixed:.3}, sliding_window {sliding:.3}, token_bucket {bucket:.3}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_instances_on_one_redis_hold_every_limit_exactly() {
    let _serial = load::serial().await;
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let instances = fleet(&rules, redis_args(&redis.url(), "single")).await;
    every_algorithm(&instances, "single").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_instances_on_a_redis_cluster_hold_every_limit_exactly() {
    let _serial = load::serial().await;
    let cluster = RedisCluster::start(3);
    let rules = Rules::new(RULES);
    let seeds = cluster.urls().join(",");
    let instances = fleet(&rules, redis_args(&seeds, "cluster")).await;
    every_algorithm(&instances, "cluster").await;
}

/// Why Redis is needed: four instances on the memory backend each keep their own count, so
/// together they admit about four times the limit. Every instance admits exactly L.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_instances_on_the_memory_backend_admit_the_limit_each() {
    let _serial = load::serial().await;
    clear_of_end(HOUR, Duration::from_secs(20)).await;
    let rules = Rules::new(RULES);
    let instances = fleet(&rules, Vec::new()).await;
    let limit = FIXED_LIMIT as usize;
    let mut spec = Spec::new(targets(&instances, &one("fixed", "memory")).await, STREAMS);
    // 1.5 L of demand per instance.
    spec.max_calls = 6 * limit;
    let samples = Load::start(spec).finish().await;
    assert_no_errors(&samples, "memory");
    let admitted = samples.iter().filter(|s| s.answer.admitted()).count();
    for id in 0..INSTANCES {
        let own = samples
            .iter()
            .filter(|s| s.target == id && s.answer.admitted())
            .count();
        assert_eq!(own, limit, "instance {id} admits its own L");
    }
    assert!(
        admitted > 3 * limit,
        "{admitted} admitted: the instances shared their counts?"
    );
    println!(
        "[system] memory  fixed_window   L={limit}/hour  calls={} admitted={admitted} by {INSTANCES} instances  admitted/limit = {:.3} (the naive failure Redis fixes)",
        samples.len(),
        admitted as f64 / limit as f64
    );
}

/// An instance killed with SIGKILL in the middle of a long window and started again continues
/// from the counts in Redis: across all instances each admission still sees its own count
/// (no `limit_remaining` repeats, which a reset would cause), and the restarted instance's
/// first answers continue below where the fleet was, for all three algorithms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instance_continues_the_counts_from_redis() {
    let _serial = load::serial().await;
    clear_of_end(HOUR, Duration::from_secs(20)).await;
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let mut instances = fleet(&rules, redis_args(&redis.url(), "single")).await;
    // One request with the three algorithms' long-window limits: all admitted all along.
    let long = request(
        "system",
        vec![
            descriptor(&[("long_fixed", "r")]),
            descriptor(&[("long_sliding", "r")]),
            descriptor(&[("long_bucket", "r")]),
        ],
    );
    let limits = [100_000u32, 10_000, 10_000];
    let bucket_rate_per_s = 10_000.0 / 3_600.0;
    let mut spec = Spec::new(targets(&instances, &long).await, 16);
    spec.pace = Duration::from_millis(2);
    spec.max_time = Duration::from_secs(20);
    let load = Load::start(spec);
    tokio::time::sleep(Duration::from_secs(1)).await;

    let killed = Instant::now();
    instances[0].kill();
    tokio::time::sleep(Duration::from_millis(300)).await;
    instances[0].kill_and_restart().await;
    let back = Instant::now();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let samples = load.stop().await;

    // Only calls to the killed instance, around its death, may fail.
    let failed = errors(&samples);
    for s in &failed {
        assert!(
            s.target == 0 && s.answered >= killed && s.sent <= back,
            "a call failed that the kill cannot explain: {s:?} (killed at +{:?}, back at +{:?})",
            killed - samples[0].sent,
            back - samples[0].sent,
        );
    }
    let before: Vec<&Sample> = samples.iter().filter(|s| s.answered < killed).collect();
    let after: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.target == 0 && s.sent > back && !s.answer.failed())
        .collect();
    assert!(!before.is_empty() && !after.is_empty());
    let remaining = |s: &Sample, i: usize| match &s.answer {
        Answer::Ok(r) => r[i],
        other => panic!("every call is admitted, got {other:?}"),
    };
    for (i, name) in ["fixed_window", "sliding_window"].iter().enumerate() {
        let mut seen: Vec<u32> = samples
            .iter()
            .filter(|s| !s.answer.failed())
            .map(|s| remaining(s, i))
            .collect();
        let admitted = seen.len();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(
            seen.len(),
            admitted,
            "{name}: a count was seen twice: something reset"
        );
        // Only the calls in flight when the instance died may have been charged unanswered.
        let in_flight = failed.iter().filter(|s| s.sent < killed).count();
        let charged = (limits[i] - seen[0]) as usize;
        assert!(
            charged >= admitted && charged - admitted <= in_flight,
            "{name}: {charged} charged for {admitted} answered admissions and {in_flight} calls in flight at the kill"
        );
        let low_before = before.iter().map(|s| remaining(s, i)).min().unwrap();
        let first_after = remaining(after[0], i);
        assert!(
            first_after < low_before,
            "{name}: the restarted instance answered remaining {first_after}, the fleet was at {low_before} before the kill"
        );
    }
    // The bucket refills slowly (10 000 per hour): the restarted instance may see it at most
    // that refill above where it was.
    let low_before = before.iter().map(|s| remaining(s, 2)).min().unwrap();
    let first_after = remaining(after[0], 2);
    let refill =
        bucket_rate_per_s * (after[0].answered - before.last().unwrap().sent).as_secs_f64();
    assert!(
        f64::from(first_after) <= f64::from(low_before) + refill.ceil() + 1.0,
        "token_bucket: the restarted instance answered remaining {first_after}, the fleet was at {low_before} before the kill"
    );
    println!(
        "[system] restart: {} calls, {} lost with the killed instance; fixed remaining {} before the kill -> {} first after the restart ({:.2?} down); counts continued",
        samples.len(),
        failed.len(),
        before.iter().map(|s| remaining(s, 0)).min().unwrap(),
        remaining(after[0], 0),
        back - killed,
    );
}
