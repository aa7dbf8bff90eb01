//! The algorithms exist twice, in Rust (the memory backend) and in Lua (the Redis scripts).
//! These tests hold the two to one behaviour: generated request sequences run through the
//! memory backend, a single Redis and a 3-master Cluster on one controlled clock, and every
//! answer (admission, remaining, reset to the microsecond) must be identical. Some steps
//! have several requests: those three decide them one after another, while a Redis of its
//! own (one connection) is given them all at once, at one instant, so that the requests
//! queued behind its call in flight share the next; its answers must be those of a second
//! memory backend deciding them one by one at that instant.
//!
//! proptest draws each sequence's seed and length and, on a disagreement, shrinks it to the
//! shortest failing prefix (and a smaller seed where one fails too); the report prints the
//! seed and length, and `DIFFERENTIAL_SEED=<seed> [DIFFERENTIAL_LENGTH=<n>] cargo test --test
//! differential` runs that sequence alone. `DIFFERENTIAL_SEQUENCES=<n>` runs more (or fewer)
//! sequences than the CI default.

mod support;

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use proptest::prelude::{ProptestConfig, any};
use proptest::test_runner::{TestCaseError, TestError, TestRunner};
use redis::cluster_routing::Slot;
use support::redis::{RedisCluster, RedisServer};
use turnstile::algorithm::Micros;
use turnstile::backend::memory::MemoryBackend;
use turnstile::backend::redis::{RedisBackend, RedisConfig, RedisMode};
use turnstile::decision::limit::{Algorithm, Limit, Unit};
use turnstile::decision::{Charging, Hit, Outcome, PermitOp, Role};

/// Sequences per run, and most steps per sequence (each draws its length up to it): ~2 500
/// requests on each backend, a few seconds on a CI runner.
const SEQUENCES: u32 = 100;
const STEPS: usize = 40;
const SEC: Micros = 1_000_000;

/// The backends under test, by the name a report gives them.
const BACKENDS: [&str; 5] = ["memory", "single", "cluster", "memory at once", "coalesced"];

/// The backends under test. The memory backend, a single Redis and a Cluster are given a
/// step's requests one after another, each at its own instant (Redis expires keys on real
/// time, which passes between them). A second memory backend and a Redis of its own (one
/// connection) are given them all at once, at the step's first instant: the requests queued
/// behind the Redis one's call in flight share the next.
struct Backends {
    memory: MemoryBackend,
    single: RedisBackend,
    cluster: RedisBackend,
    at_once: MemoryBackend,
    coalesced: RedisBackend,
    /// Requests given to the coalesced backend so far (to compare with its script calls).
    requests: AtomicUsize,
}

impl Backends {
    /// The first three backends' answers to one request at `now`.
    async fn one(&self, hits: &[Hit], charging: Charging, now: Micros) -> [Vec<Outcome>; 3] {
        let memory = self
            .memory
            .evaluate_now(hits, charging, now)
            .expect("memory");
        let single = self.single.evaluate_at(hits, charging, now).await;
        let cluster = self.cluster.evaluate_at(hits, charging, now).await;
        [
            memory,
            single.expect("single redis"),
            cluster.expect("cluster"),
        ]
    }

    /// The other two backends' answers to `requests`, all at `now`.
    async fn at_once(&self, requests: &[Request], now: Micros) -> [Vec<Vec<Outcome>>; 2] {
        self.requests.fetch_add(requests.len(), Ordering::Relaxed);
        let memory = requests
            .iter()
            .map(|(hits, charging)| {
                self.at_once
                    .evaluate_now(hits, *charging, now)
                    .expect("memory")
            })
            .collect();
        // Each request joins the coalesced backend's queue when first polled, in order.
        let coalesced = join_all(
            requests
                .iter()
                .map(|(hits, charging)| self.coalesced.evaluate_at(hits, *charging, now)),
        )
        .await;
        let coalesced = coalesced
            .into_iter()
            .map(|answer| answer.expect("coalesced redis"))
            .collect();
        [memory, coalesced]
    }
}

async fn backends(server: &RedisServer, cluster: &RedisCluster, alone: &RedisServer) -> Backends {
    let config = |urls, mode| RedisConfig {
        urls,
        mode,
        // Generous: a busy machine must not turn a slow call into a failure.
        call_timeout: Duration::from_secs(5),
        connect_timeout: Duration::from_secs(5),
        ..RedisConfig::default()
    };
    let connect = |config: RedisConfig| async move {
        RedisBackend::connect(&config)
            .await
            .expect("connect to redis")
    };
    let memory = || MemoryBackend::new(1_000_000, turnstile::backend::memory::DEFAULT_MAX_BYTES);
    Backends {
        memory: memory(),
        at_once: memory(),
        single: connect(config(vec![server.url()], RedisMode::Single)).await,
        cluster: connect(config(cluster.urls(), RedisMode::Cluster)).await,
        // One call in flight: the requests behind it wait, in order, for the next.
        coalesced: connect(RedisConfig {
            connections: 1,
            ..config(vec![alone.url()], RedisMode::Single)
        })
        .await,
        requests: AtomicUsize::new(0),
    }
}

fn limit(algorithm: Algorithm, requests_per_unit: u32, window: u64, burst: u32) -> Limit {
    let unit = match window {
        60 => Unit::Minute,
        3_600 => Unit::Hour,
        _ => Unit::Second,
    };
    Limit {
        requests_per_unit,
        unit,
        algorithm,
        burst,
        window,
        quota_lease: 0,
    }
}

// ---- generated sequences ---------------------------------------------------------------

/// A rule as the generator sees it: a descriptor with one or more limits, each possibly
/// split over shards.
struct Rule {
    name: String,
    limits: Vec<(Limit, u32)>,
    role: Role,
}

fn random_limit(rng: &mut fastrand::Rng) -> Limit {
    let algorithm = Algorithm::ALL[rng.usize(..Algorithm::ALL.len())];
    let window = [1, 10, 60][rng.usize(..3)];
    let rate = if rng.u8(..20) == 0 { 0 } else { rng.u32(1..=8) };
    let burst = match algorithm.takes_burst() {
        true => rng.u32(1..=rate.max(1) + 2),
        false => rate,
    };
    limit(algorithm, rate, window, burst)
}

/// Rules named after the sequence's `run` (distinct at every run, so a shrunk rerun of a seed
/// starts from fresh state in every backend).
fn rules(rng: &mut fastrand::Rng, run: u64) -> Vec<Rule> {
    (0..rng.usize(2..=4))
        .map(|n| {
            let mut limits: Vec<(Limit, u32)> = Vec::new();
            for _ in 0..rng.usize(1..=2) {
                let l = random_limit(rng);
                // Several limits of one rule never share state (the key has algorithm and
                // window), so a second limit of the same kind is left out.
                if limits
                    .iter()
                    .all(|(o, _)| (o.algorithm, o.window) != (l.algorithm, l.window))
                {
                    let shards = if rng.u8(..4) == 0 && l.requests_per_unit >= 2 {
                        rng.u32(2..=l.requests_per_unit.min(3))
                    } else {
                        1
                    };
                    limits.push((l, shards));
                }
            }
            let role = match rng.u8(..10) {
                0 => Role::Shadow,
                1 => Role::Quota,
                _ => Role::Enforce,
            };
            Rule {
                name: format!("r{run}|d{n}"),
                limits,
                role,
            }
        })
        .collect()
}

/// Shard `shard` of `shards`: the limit divided so the shards add up to the whole.
fn share(limit: Limit, shard: u32, shards: u32) -> Limit {
    let part = |n: u32| n / shards + u32::from(shard < n % shards);
    Limit {
        requests_per_unit: part(limit.requests_per_unit),
        burst: part(limit.burst).max(1),
        ..limit
    }
}

fn key(rule: &Rule, limit: &Limit, shard: Option<u32>) -> String {
    let mut key = format!("{}|{}:{}", rule.name, limit.algorithm, limit.window);
    if let Some(shard) = shard {
        let _ = write!(key, "|#{shard}");
    }
    key
}

/// The hits one descriptor on `rule` asks for, as the plan builds them: every limit of the
/// rule (on a random shard), or a request's `limit` override in their place.
fn descriptor_hits(rng: &mut fastrand::Rng, rule: &Rule) -> Vec<Hit> {
    let units = match rng.u8(..10) {
        0 | 1 => 0,
        2 => 2,
        3 => rng.u64(3..=10),
        _ => 1,
    };
    let release = rng.u8(..6) == 0;
    let request_id = format!("r{}", rng.u8(..4));
    let placed: Vec<(Limit, Option<u32>)> = if rng.u8(..8) == 0 {
        // An override: a fixed window of the request's own number and unit, counting on the
        // rule's counter when the window is the same.
        let window = [1, 60][rng.usize(..2)];
        let rate = rng.u32(0..=6);
        vec![(limit(Algorithm::FixedWindow, rate, window, rate), None)]
    } else {
        rule.limits
            .iter()
            .map(|&(l, shards)| {
                if shards > 1 {
                    let shard = rng.u32(..shards);
                    (share(l, shard, shards), Some(shard))
                } else {
                    (l, None)
                }
            })
            .collect()
    };
    placed
        .into_iter()
        .map(|(limit, shard)| {
            let permit = limit
                .algorithm
                .in_flight()
                .then(|| match (release, units) {
                    (true, _) => Some((PermitOp::Release, request_id.clone())),
                    (false, 0) => None,
                    (false, _) => Some((PermitOp::Acquire, request_id.clone())),
                })
                .flatten();
            Hit {
                key: key(rule, &limit, shard),
                limit,
                units: if release && permit.is_some() {
                    1
                } else {
                    units
                },
                role: rule.role,
                permit,
            }
        })
        .collect()
}

/// How far the clock moves before the next request: nothing much, a little, across window
/// edges, or exactly to (or one microsecond either side of) a reset the last answer gave.
fn step(rng: &mut fastrand::Rng, last: &[Outcome]) -> Micros {
    match rng.u8(..10) {
        0..=2 => rng.u64(..2_000),
        3..=5 => rng.u64(..1_500_000),
        6 | 7 => rng.u64(..70 * SEC),
        _ => {
            let Some(o) = (!last.is_empty()).then(|| last[rng.usize(..last.len())]) else {
                return 0;
            };
            (o.reset_after.as_micros() as Micros + rng.u64(..3)).saturating_sub(1)
        }
    }
}

/// Runs so far: each sequence run gets its own keys.
static RUNS: AtomicU64 = AtomicU64::new(0);

/// Run the first `length` steps of the sequence of `seed`; on the first disagreement, a
/// report of what led to it. A step is one request, or a few at one instant (which the
/// coalesced backend decides in shared calls).
async fn sequence(backends: &Backends, seed: u64, length: usize) -> Result<(), String> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let run = RUNS.fetch_add(1, Ordering::Relaxed);
    let rules = rules(&mut rng, run);
    let mut now: Micros = 1_800_000_000 * SEC + rng.u64(..3_600 * SEC);
    let mut last: Vec<Outcome> = Vec::new();
    let mut log = String::new();
    let mut started = Instant::now();
    for n in 0..length {
        // Redis expires keys on its own clock: the controlled clock must never move slower
        // than the real one (plus Redis's millisecond granularity), or a key could expire in
        // Redis while the memory backend still holds its state.
        let real = started.elapsed().as_micros() as Micros + 2_000;
        now += step(&mut rng, &last).max(real);
        started = Instant::now();

        let together = if rng.u8(..4) == 0 {
            rng.usize(2..=6)
        } else {
            1
        };
        let requests: Vec<Request> = (0..together).map(|_| request(&mut rng, &rules)).collect();
        let first = now;
        let mut answers: [Vec<Vec<Outcome>>; 5] = Default::default();
        for (r, (hits, charging)) in requests.iter().enumerate() {
            if r > 0 {
                // Real time passed since the last request: the clock follows, as above.
                now += started.elapsed().as_micros() as Micros + 2_000;
                started = Instant::now();
            }
            let one = backends.one(hits, *charging, now).await;
            let _ = writeln!(log, "#{n}.{r} at {now} {charging:?}:");
            for (h, o) in hits.iter().zip(&one[0]) {
                let _ = writeln!(
                    log,
                    "  {} {}/{}s burst {} {:?} cost {} {:?} {:?} -> {:?}",
                    h.key,
                    h.limit.requests_per_unit,
                    h.limit.window,
                    h.limit.burst,
                    h.role,
                    h.units,
                    h.permit,
                    h.limit.algorithm,
                    o
                );
            }
            for (answer, outcomes) in answers.iter_mut().zip(one) {
                answer.push(outcomes);
            }
        }
        let [at_once, coalesced] = backends.at_once(&requests, first).await;
        (answers[3], answers[4]) = (at_once, coalesced);
        if answers[1..3].iter().any(|a| *a != answers[0]) || answers[4] != answers[3] {
            let mut report = format!(
                "seed {seed}, length {length}: the backends disagree at step #{n} (the last \
                 two deciding all its requests at {first})\n{log}"
            );
            for (name, answer) in BACKENDS.iter().zip(&answers) {
                let _ = writeln!(report, "{name:>14}: {answer:?}");
            }
            return Err(report);
        }
        last = answers[0].concat();
    }
    Ok(())
}

/// A request of one to three descriptors on `rules`, charged as drawn.
fn request(rng: &mut fastrand::Rng, rules: &[Rule]) -> Request {
    let mut hits = Vec::new();
    for _ in 0..rng.usize(1..=3) {
        let rule = &rules[rng.usize(..rules.len())];
        hits.extend(descriptor_hits(rng, rule));
    }
    let charging = match rng.u8(..10) {
        0 => Charging::PerDescriptor,
        1 => Charging::Nothing,
        _ => Charging::Atomic,
    };
    (hits, charging)
}

/// One request: its hits and how it charges.
type Request = (Vec<Hit>, Charging);

/// Drifts the generated sequences found, kept as rows: requests (hits, charging), then the
/// answer every backend must give to the last one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drifts_once_found_stay_fixed() {
    let (server, alone) = (RedisServer::start(), RedisServer::start());
    let cluster = RedisCluster::shared();
    let backends = backends(&server, &cluster, &alone).await;
    let five = limit(Algorithm::Concurrency, 5, 60, 5);
    let permit = |key: &str, op, id: &str| Hit {
        key: key.into(),
        limit: five,
        units: 1,
        role: Role::Enforce,
        permit: Some((op, id.into())),
    };
    let read = |key: &str| Hit {
        units: 0,
        permit: None,
        ..permit(key, PermitOp::Acquire, "")
    };
    // A key in another Cluster slot than "permit-*", refusing everything.
    let never = Hit {
        key: "never".into(),
        limit: limit(Algorithm::FixedWindow, 0, 60, 0),
        units: 1,
        role: Role::Enforce,
        permit: None,
    };
    assert_ne!(
        Slot::for_key("{permit-b}"),
        Slot::for_key("{never}"),
        "the refusal must come from another slot, so the Cluster reserves and refunds"
    );
    let acquire = |key| permit(key, PermitOp::Acquire, "r");
    let release = |key| permit(key, PermitOp::Release, "r");
    let rows: Vec<(&str, Vec<Request>, Outcome)> = vec![
        (
            // seed 2487400033279472955: undoing the uncharged re-acquire put back the permit
            // the release in the same request had given back.
            "a permit given back in an uncharged request stays given back",
            vec![
                (vec![acquire("permit-a")], Charging::Atomic),
                (
                    vec![acquire("permit-a"), release("permit-a")],
                    Charging::Nothing,
                ),
                (vec![read("permit-a")], Charging::Atomic),
            ],
            Outcome {
                admitted: true,
                remaining: 5,
                reset_after: Duration::from_secs(60),
            },
        ),
        (
            // Found by mutation: the Cluster refund of a refused request removed a permit the
            // request had held before it.
            "a refused request refunds a permit it already held by keeping it",
            vec![
                (vec![acquire("permit-b")], Charging::Atomic),
                (vec![acquire("permit-b"), never.clone()], Charging::Atomic),
                (vec![read("permit-b")], Charging::Atomic),
            ],
            Outcome {
                admitted: true,
                remaining: 4,
                reset_after: Duration::from_secs(60),
            },
        ),
    ];
    let mut now = 1_900_000_000 * SEC;
    for (what, requests, expected) in rows {
        let mut answers = Vec::new();
        for request in requests {
            now += 10_000;
            let [at_once, coalesced] = backends.at_once(std::slice::from_ref(&request), now).await;
            let (hits, charging) = request;
            answers = backends.one(&hits, charging, now).await.to_vec();
            answers.extend([at_once.concat(), coalesced.concat()]);
        }
        for (backend, answer) in BACKENDS.iter().zip(&answers) {
            assert_eq!(answer.as_slice(), [expected], "{what}: {backend}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_backend_gives_identical_answers_to_generated_sequences() {
    let (server, alone) = (RedisServer::start(), RedisServer::start());
    let cluster = RedisCluster::shared();
    let backends = backends(&server, &cluster, &alone).await;
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    if let Some(seed) = env("DIFFERENTIAL_SEED") {
        let length = env("DIFFERENTIAL_LENGTH").map_or(STEPS, |n| n as usize);
        if let Err(report) = sequence(&backends, seed, length).await {
            panic!("{report}");
        }
        return;
    }
    let config = ProptestConfig {
        cases: env("DIFFERENTIAL_SEQUENCES").map_or(SEQUENCES, |n| n as u32),
        // The report names the seed; no regression file is written into the tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let cases = config.cases;
    let runtime = tokio::runtime::Handle::current();
    let result = tokio::task::block_in_place(|| {
        TestRunner::new(config).run(&(any::<u64>(), 1..=STEPS), |(seed, length)| {
            runtime
                .block_on(sequence(&backends, seed, length))
                .map_err(TestCaseError::fail)
        })
    });
    match result {
        Ok(()) => {}
        Err(TestError::Fail(report, (seed, length))) => {
            panic!("shrunk to seed {seed}, length {length}:\n{report}")
        }
        Err(other) => panic!("{other}"),
    }
    // The coalesced backend must really have decided requests together.
    let requests = backends.requests.load(Ordering::Relaxed) as u64;
    let calls = alone.script_calls();
    println!("{cases} sequences, {requests} requests on each backend, in {calls} coalesced calls");
    assert!(
        calls < requests,
        "{requests} requests in {calls} calls: the coalesced backend never shared a call"
    );
}
