//! The Redis backend against real redis-server processes: the algorithms' answers, the
//! atomicity of a request (across Cluster slots too), key hygiene, and what must not break a
//! request (a flushed script cache, a restart, a frozen server, a Sentinel failover).

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use redis::cluster_routing::Slot;
use support::clock::{CALLS_SPAN, HOUR, MINUTE, clear_of_end};
use support::redis::{RedisCluster, RedisServer};
use tokio::time::sleep;
use turnstile::backend::Backend;
use turnstile::backend::memory::MemoryBackend;
use turnstile::backend::redis::{RedisBackend, RedisConfig, RedisMode};
use turnstile::decision::deadline::Deadline;
use turnstile::decision::limit::{Algorithm, Limit, Unit};
use turnstile::decision::{BackendError, Charging, Hit, Outcome, PermitOp, Role};

const SEC: Duration = Duration::from_secs(1);
const MINUTE_US: u64 = 60_000_000;

/// Rules of the tests that run the binary: domain `d`, key `k`, 5 an hour.
const FIVE_AN_HOUR: &str =
    "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";

/// The algorithms that count units over time (concurrency limits have tests of their own:
/// their hits need a permit).
const RATE_ALGORITHMS: [Algorithm; 3] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingWindow,
    Algorithm::TokenBucket,
];

// ---- helpers -------------------------------------------------------------------------------

/// Generous call timeout: a busy machine must not make a test flake.
fn config(urls: Vec<String>, mode: RedisMode, prefix: &str) -> RedisConfig {
    RedisConfig {
        urls,
        mode,
        key_prefix: prefix.into(),
        call_timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(2),
        ..RedisConfig::default()
    }
}

async fn single(server: &RedisServer, prefix: &str) -> RedisBackend {
    RedisBackend::connect(&config(vec![server.url()], RedisMode::Single, prefix))
        .await
        .expect("connect to redis")
}

async fn clustered(cluster: &RedisCluster, prefix: &str) -> RedisBackend {
    RedisBackend::connect(&config(cluster.urls(), RedisMode::Cluster, prefix))
        .await
        .expect("connect to the cluster")
}

fn limit(algorithm: Algorithm, requests_per_unit: u32, unit: Unit) -> Limit {
    Limit {
        requests_per_unit,
        unit,
        algorithm,
        burst: requests_per_unit,
        window: unit.seconds(),
        quota_lease: 0,
    }
}

fn hit(key: &str, limit: Limit, units: u64) -> Hit {
    Hit {
        key: key.into(),
        limit,
        units,
        role: Role::Enforce,
        permit: None,
    }
}

fn role(hit: Hit, role: Role) -> Hit {
    Hit { role, ..hit }
}

async fn eval(backend: &impl Backend, hits: &[Hit], charging: Charging) -> Vec<Outcome> {
    backend.evaluate(hits, charging).await.expect("evaluate")
}

/// A backend on one server over `connections` connections (each a call slot of its lane),
/// its keys under `prefix`.
async fn over_connections(server: &RedisServer, connections: usize, prefix: &str) -> RedisBackend {
    RedisBackend::connect(&RedisConfig {
        connections,
        ..config(vec![server.url()], RedisMode::Single, prefix)
    })
    .await
    .unwrap()
}

async fn one(backend: &impl Backend, hit: &Hit) -> Outcome {
    eval(backend, std::slice::from_ref(hit), Charging::Atomic).await[0]
}

/// `one`, then wait until the connections this thread opens for itself at its first call
/// (`home`, `connections` of them) are open and carry its calls, so that the calls after it
/// all go in one lane, on those connections: reads (nothing charged) until one runs its
/// script on a connection newer than the call.
async fn settled(
    server: &RedisServer,
    backend: &RedisBackend,
    connections: usize,
    hit: &Hit,
) -> Outcome {
    let newest = server.clients().iter().map(|c| c.0).max().unwrap_or(0);
    let outcome = one(backend, hit).await;
    let read = Hit {
        units: 0,
        ..hit.clone()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let own: Vec<_> = server
            .clients()
            .into_iter()
            .filter(|c| c.0 > newest)
            .collect();
        if own.len() >= connections
            && own
                .iter()
                .any(|(_, cmd)| cmd == "fcall" || cmd == "evalsha")
        {
            return outcome;
        }
        assert!(
            Instant::now() < deadline,
            "this thread's own connections carry no call: {own:?}"
        );
        one(backend, &read).await;
        sleep(Duration::from_millis(10)).await;
    }
}

/// Let the tasks this (current-thread) test spawned run until each waits: they run only
/// while the test's own task yields, and none waits on a timer.
async fn run_the_others() {
    for _ in 0..16 {
        tokio::task::yield_now().await;
    }
}

fn us(d: Duration) -> u64 {
    d.as_micros() as u64
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// Every key under `pattern` with its content, to prove a step wrote nothing.
fn snapshot(server: &RedisServer, pattern: &str) -> BTreeMap<String, String> {
    server
        .keys(pattern)
        .into_iter()
        .map(|key| {
            let kind: String = server.query(&["TYPE", &key]);
            let value = match kind.as_str() {
                "string" => server.query::<String>(&["GET", &key]),
                "zset" => server
                    .query::<Vec<String>>(&["ZRANGE", &key, "0", "-1", "WITHSCORES"])
                    .join(","),
                other => panic!("unexpected {other} key {key}"),
            };
            (key, value)
        })
        .collect()
}

/// Names `<base>-<n>` whose Redis keys (under `prefix`) fall in pairwise different slots.
fn distinct_slots(prefix: &str, base: &str, count: usize) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    let mut slots = Vec::new();
    for n in 0.. {
        let name = format!("{base}-{n}");
        let slot = Slot::for_key(format!("{prefix}{{{name}}}"));
        if !slots.contains(&slot) {
            slots.push(slot);
            names.push(name);
            if names.len() == count {
                break;
            }
        }
    }
    names
}

fn slot_number(cluster_node: &RedisServer, key: &str) -> u16 {
    cluster_node.query(&["CLUSTER", "KEYSLOT", key])
}

/// The caches a server may run the batch script from: turnstile uses the function library
/// where the server has functions, the script cache where not.
const SCRIPTS: &str = "number_of_cached_scripts";
const LIBRARIES: &str = "number_of_libraries";

/// How many entries of a cache (`SCRIPTS`, `LIBRARIES`) the server holds.
fn cached(server: &RedisServer, field: &str) -> u64 {
    let info: String = server.query(&["INFO", "memory"]);
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("{field} in INFO memory"))
        .trim()
        .parse()
        .expect("a number")
}

// ---- the algorithms' answers ---------------------------------------------------------------

/// Multi-descriptor requests with every role and both chargings: the backends must agree on
/// every verdict and count, and on the reset within clock skew.
async fn fixed_window_script(backend: &impl Backend) -> Vec<Outcome> {
    let fixed = |n| limit(Algorithm::FixedWindow, n, Unit::Hour);
    let (a, b, c, d) = (fixed(5), fixed(2), fixed(3), fixed(3));
    let shadow = role(hit("s", fixed(0), 1), Role::Shadow);
    let q1 = role(hit("q1", fixed(1), 1), Role::Quota);
    let q2 = role(hit("q2", fixed(1), 1), Role::Quota);
    let requests: Vec<(Vec<Hit>, Charging)> = vec![
        (vec![hit("a", a, 1)], Charging::Atomic),
        (vec![hit("a", a, 1), hit("b", b, 1)], Charging::Atomic),
        (vec![hit("a", a, 2), hit("b", b, 1)], Charging::Atomic),
        (vec![hit("a", a, 0)], Charging::Atomic),
        (vec![hit("a", a, 1), hit("b", b, 1)], Charging::Atomic),
        (vec![hit("a", a, 1)], Charging::Atomic),
        (vec![hit("a", a, 1)], Charging::Atomic),
        (vec![hit("c", c, 1), shadow], Charging::Atomic),
        (
            vec![hit("c", c, 1), q1.clone(), q2.clone()],
            Charging::Atomic,
        ),
        (vec![hit("c", c, 1), q1, q2], Charging::Atomic),
        (vec![hit("c", c, 1)], Charging::Atomic),
        (
            vec![hit("d", d, 1), hit("b", b, 1)],
            Charging::PerDescriptor,
        ),
        (vec![hit("d", d, 0)], Charging::Atomic),
        (vec![hit("d", d, 6)], Charging::Atomic),
    ];
    let mut all = Vec::new();
    for (hits, charging) in requests {
        all.extend(eval(backend, &hits, charging).await);
    }
    all
}

#[tokio::test]
async fn cluster_single_and_memory_give_the_same_fixed_window_answers() {
    clear_of_end(HOUR, 5 * SEC).await;
    let cluster = RedisCluster::shared();
    let server = RedisServer::start();
    let memory = fixed_window_script(&MemoryBackend::new(
        1000,
        turnstile::backend::memory::DEFAULT_MAX_BYTES,
    ))
    .await;
    let single = fixed_window_script(&single(&server, "eq:").await).await;
    let clustered = fixed_window_script(&clustered(&cluster, "eq:").await).await;

    let verdicts = |o: &[Outcome]| {
        o.iter()
            .map(|o| (o.admitted, o.remaining))
            .collect::<Vec<_>>()
    };
    #[rustfmt::skip]
    let expected = vec![
        (true, 4),
        (true, 3), (true, 1),
        (true, 1), (true, 0),
        (true, 1),
        (true, 0), (false, 0), // refused: "a" not charged
        (true, 0),
        (false, 0),
        (true, 2), (false, 0), // shadow refusals refuse nothing
        (true, 1), (true, 0), (true, 0),
        (true, 0), (false, 0), (false, 0), // every quota refused: nothing charged
        (true, 0),
        (true, 2), (false, 0), // per descriptor: "d" charged anyway
        (true, 2),
        (false, 0),
    ];
    assert_eq!(verdicts(&memory), expected);
    assert_eq!(verdicts(&single), expected, "single Redis");
    assert_eq!(verdicts(&clustered), expected, "Redis Cluster");

    let hour_left = Duration::from_micros(us(HOUR) - now_us() % us(HOUR));
    for (name, outcomes) in [("single", &single), ("cluster", &clustered)] {
        for (o, m) in outcomes.iter().zip(&memory) {
            assert!(
                o.reset_after.abs_diff(m.reset_after) < SEC,
                "{name}: {o:?} vs {m:?}"
            );
            assert!(o.reset_after.abs_diff(hour_left) < 2 * SEC, "{name}: {o:?}");
        }
    }
}

#[tokio::test]
async fn sliding_window_remaining_and_reset_are_exact() {
    let server = RedisServer::start();
    let b = single(&server, "sw:").await;
    let k = |hits| hit("k", limit(Algorithm::SlidingWindow, 3, Unit::Minute), hits);

    let read = one(&b, &k(0)).await;
    assert_eq!(
        (read.admitted, read.remaining, us(read.reset_after)),
        (true, 3, 0)
    );
    assert!(server.keys("sw:*").is_empty(), "a read creates nothing");

    let before_first = Instant::now();
    let first = one(&b, &k(1)).await;
    assert_eq!(
        (first.admitted, first.remaining, us(first.reset_after)),
        (true, 2, MINUTE_US)
    );
    // 100 ms apart, so the retry times of the two entries can be told apart.
    sleep(Duration::from_millis(100)).await;
    let second = one(&b, &k(2)).await;
    assert_eq!(
        (second.admitted, second.remaining, us(second.reset_after)),
        (true, 0, MINUTE_US)
    );

    // Refused: back when the first entry (cost 1) leaves the window...
    let refused = one(&b, &k(1)).await;
    let elapsed = us(before_first.elapsed());
    assert_eq!((refused.admitted, refused.remaining), (false, 0));
    let reset = us(refused.reset_after);
    assert!(reset < MINUTE_US && reset > MINUTE_US - elapsed, "{reset}");
    // ...or when the second one (100 ms younger) does too, for a hit of cost 2.
    let refused_two = one(&b, &k(2)).await;
    assert!(!refused_two.admitted);
    assert!(refused_two.reset_after > refused.reset_after + Duration::from_millis(50));
    assert!(us(refused_two.reset_after) < MINUTE_US);
    // A cost above the limit can never pass: a whole window.
    let never = one(&b, &k(4)).await;
    assert_eq!((never.admitted, us(never.reset_after)), (false, MINUTE_US));
    // At the limit, a read passes and reports when the newest entry leaves.
    let at_limit = one(&b, &k(0)).await;
    assert_eq!((at_limit.admitted, at_limit.remaining), (true, 0));
    let newest = us(at_limit.reset_after);
    assert!(newest < MINUTE_US && newest > MINUTE_US - us(before_first.elapsed()));

    assert_eq!(
        server.query::<u64>(&["ZCARD", "sw:{k}"]),
        2,
        "refused hits are not logged"
    );
    assert_eq!(server.query::<u64>(&["GET", "sw:{k}:n"]), 3);
}

#[tokio::test]
async fn token_bucket_remaining_and_reset_are_exact() {
    let server = RedisServer::start();
    let b = single(&server, "tb:").await;
    // 60 per minute: one token per second, burst 3.
    let bucket = Limit {
        burst: 3,
        ..limit(Algorithm::TokenBucket, 60, Unit::Minute)
    };
    let k = |hits| hit("k", bucket, hits);

    let read = one(&b, &k(0)).await;
    assert_eq!(
        (read.admitted, read.remaining, us(read.reset_after)),
        (true, 3, 0)
    );
    assert!(server.keys("tb:*").is_empty(), "a read creates nothing");

    let before_first = Instant::now();
    let first = one(&b, &k(1)).await;
    assert_eq!(
        (first.admitted, first.remaining, us(first.reset_after)),
        (true, 2, 1_000_000)
    );
    let second = one(&b, &k(2)).await;
    let elapsed = us(before_first.elapsed());
    assert_eq!((second.admitted, second.remaining), (true, 0));
    let full_in = us(second.reset_after);
    assert!(
        full_in <= 3_000_000 && full_in > 3_000_000 - elapsed,
        "{full_in}"
    );

    let refused = one(&b, &k(1)).await;
    let elapsed = us(before_first.elapsed());
    assert_eq!((refused.admitted, refused.remaining), (false, 0));
    let retry = us(refused.reset_after);
    assert!(retry < 1_000_000 && retry > 1_000_000 - elapsed, "{retry}");

    let never = one(&b, &k(4)).await;
    assert_eq!(
        (never.admitted, us(never.reset_after)),
        (false, MINUTE_US),
        "cost above the burst"
    );
    let empty = one(&b, &k(0)).await;
    assert_eq!((empty.admitted, empty.remaining), (true, 0));
    assert!(empty.reset_after <= second.reset_after);
    // The TAT is all the state, and it expires when the bucket is full again.
    let ttl: i64 = server.query(&["PTTL", "tb:{k}"]);
    assert!(ttl > 1_000 && ttl <= 3_002, "{ttl}");
}

#[tokio::test]
async fn fixed_window_admits_twice_the_limit_across_a_boundary() {
    let server = RedisServer::start();
    let b = single(&server, "fb:").await;
    let k = hit("k", limit(Algorithm::FixedWindow, 3, Unit::Second), 1);
    // Hammer from 300 ms before a second boundary to 300 ms after it; retry if the machine
    // stalled so much that the run did not straddle a boundary.
    for _attempt in 0..3 {
        let into = now_us() % 1_000_000;
        sleep(Duration::from_micros((1_700_000 - into) % 1_000_000)).await;
        let (started, start) = (now_us(), Instant::now());
        let mut admitted = Vec::new();
        while start.elapsed() < Duration::from_millis(600) {
            let sent = Instant::now();
            if one(&b, &k).await.admitted {
                admitted.push((sent, Instant::now()));
            }
            sleep(Duration::from_millis(5)).await;
        }
        if started / 1_000_000 == now_us() / 1_000_000 {
            continue;
        }
        assert_eq!(admitted.len(), 6, "3 before the boundary and 3 after");
        let span = admitted[5].1 - admitted[0].0;
        assert!(span < SEC, "6 admissions within {span:?}");
        return;
    }
    panic!("never straddled a window boundary");
}

#[tokio::test]
async fn sliding_window_never_admits_more_than_the_limit_in_any_window() {
    let server = RedisServer::start();
    let b = single(&server, "sl:").await;
    let k = hit("k", limit(Algorithm::SlidingWindow, 5, Unit::Second), 1);
    let start = Instant::now();
    let mut admitted = Vec::new();
    while start.elapsed() < Duration::from_millis(2_200) {
        let sent = Instant::now();
        if one(&b, &k).await.admitted {
            admitted.push((sent, Instant::now()));
        }
        sleep(Duration::from_millis(10)).await;
    }
    // Redis admitted hit i somewhere between its send and its reply, so the 6th admission
    // after it came at most `reply(i+5) - sent(i)` later: that must still be a full second.
    for pair in admitted.windows(6) {
        let (first_sent, last_reply) = (pair[0].0, pair[5].1);
        assert!(
            last_reply - first_sent >= SEC,
            "6 admissions within {:?}",
            last_reply - first_sent
        );
    }
    assert!(
        (10..=15).contains(&admitted.len()),
        "{} admissions in 2.2 s",
        admitted.len()
    );
}

#[tokio::test]
async fn token_bucket_admits_the_burst_then_the_steady_rate() {
    let server = RedisServer::start();
    let b = single(&server, "ts:").await;
    // 10 per second (one per 100 ms), burst 5.
    let bucket = Limit {
        burst: 5,
        ..limit(Algorithm::TokenBucket, 10, Unit::Second)
    };
    let k = hit("k", bucket, 1);
    let mut admitted = Vec::new();
    let start = Instant::now();
    for _ in 0..5 {
        let sent = Instant::now();
        assert!(one(&b, &k).await.admitted, "the burst passes back to back");
        admitted.push((sent, Instant::now()));
    }
    let sent = Instant::now();
    let sixth = one(&b, &k).await;
    if sixth.admitted {
        // Only once a token came back, a tenth of a second after the burst's first hit.
        let after = start.elapsed();
        assert!(
            after >= Duration::from_millis(100),
            "the bucket was not empty after the burst: admitted at {after:?}"
        );
        admitted.push((sent, Instant::now()));
    } else {
        assert!(sixth.reset_after <= Duration::from_millis(100), "{sixth:?}");
    }
    while start.elapsed() < Duration::from_millis(1_500) {
        let sent = Instant::now();
        if one(&b, &k).await.admitted {
            admitted.push((sent, Instant::now()));
        }
        sleep(Duration::from_millis(5)).await;
    }
    // A token bucket admits at most burst + span / interval in any span; Redis admitted hit i
    // between its send and its reply, so the span from i to j is at most reply(j) - sent(i).
    for i in 0..admitted.len() {
        for j in i + 1..admitted.len() {
            let span = admitted[j].1 - admitted[i].0;
            let allowed = 5.0 + span.as_secs_f64() / 0.1;
            assert!(
                (j - i + 1) as f64 <= allowed,
                "{} admissions within {span:?}",
                j - i + 1
            );
        }
    }
    let steady = admitted.len() - 5;
    assert!((12..=16).contains(&steady), "{steady} at the steady rate");
}

#[tokio::test]
async fn costs_above_one_count_and_zero_costs_only_read() {
    let server = RedisServer::start();
    let b = single(&server, "hz:").await;
    for algorithm in RATE_ALGORITHMS {
        clear_of_end(MINUTE, CALLS_SPAN).await;
        let pattern = format!("hz:{{{algorithm}}}*");
        let k = |hits| hit(algorithm.name(), limit(algorithm, 5, Unit::Minute), hits);
        let read = one(&b, &k(0)).await;
        assert_eq!((read.admitted, read.remaining), (true, 5), "{algorithm}");
        assert!(
            server.keys(&pattern).is_empty(),
            "{algorithm}: a read creates nothing"
        );

        assert_eq!(one(&b, &k(3)).await.remaining, 2, "{algorithm}");
        let charged = snapshot(&server, &pattern);
        assert!(!charged.is_empty(), "{algorithm}");
        assert_eq!(one(&b, &k(0)).await.remaining, 2, "{algorithm}");
        assert!(!one(&b, &k(3)).await.admitted, "{algorithm}");
        assert_eq!(
            snapshot(&server, &pattern),
            charged,
            "{algorithm}: reads and refusals write nothing"
        );
        let last = one(&b, &k(2)).await;
        assert_eq!((last.admitted, last.remaining), (true, 0), "{algorithm}");
    }
}

// ---- atomicity of a request ----------------------------------------------------------------

/// A wide and a narrow limit of each algorithm in one request: a refusal by the narrow one
/// charges the wide one only under per-descriptor charging.
async fn refusal_charges_per_charging_mode(
    b: &RedisBackend,
    names: impl Fn(Algorithm) -> Vec<String>,
) {
    for algorithm in RATE_ALGORITHMS {
        clear_of_end(MINUTE, CALLS_SPAN).await;
        let names = names(algorithm);
        let wide = hit(&names[0], limit(algorithm, 10, Unit::Minute), 1);
        let narrow = hit(&names[1], limit(algorithm, 1, Unit::Minute), 1);
        let both = [wide.clone(), narrow];
        let first = eval(b, &both, Charging::Atomic).await;
        assert_eq!(
            (first[0].admitted, first[0].remaining, first[1].admitted),
            (true, 9, true)
        );
        let refused = eval(b, &both, Charging::Atomic).await;
        assert_eq!(
            (refused[0].admitted, refused[1].admitted),
            (true, false),
            "{algorithm}"
        );
        let wide_read = hit(&wide.key, wide.limit, 0);
        assert_eq!(
            one(b, &wide_read).await.remaining,
            9,
            "{algorithm}: atomic charges nothing"
        );
        eval(b, &both, Charging::PerDescriptor).await;
        assert_eq!(
            one(b, &wide_read).await.remaining,
            8,
            "{algorithm}: per descriptor charges"
        );
    }
}

/// Rows: one server, and a Cluster with every wide/narrow pair in different slots (so each
/// goes through reservation and refund).
#[tokio::test]
async fn a_refused_request_charges_according_to_the_charging_mode() {
    let server = RedisServer::start();
    let b = single(&server, "at:").await;
    refusal_charges_per_charging_mode(&b, |a| vec![format!("wide-{a}"), format!("narrow-{a}")])
        .await;
    let cluster = RedisCluster::shared();
    let b = clustered(&cluster, "xat:").await;
    refusal_charges_per_charging_mode(&b, |a| distinct_slots("xat:", a.name(), 2)).await;
}

#[tokio::test]
async fn cluster_refund_finds_the_reserved_entries_of_every_hit() {
    let cluster = RedisCluster::shared();
    let b = clustered(&cluster, "xr:").await;
    clear_of_end(MINUTE, CALLS_SPAN).await;
    let key = |name: &str| format!("xr:{{{name}}}");
    // a, z and c share a slot, so they share a call (as its hits 1, 2, 3), and z costs
    // nothing: its refund must still hold c's place, which names c's log entry. b and d live
    // elsewhere, and b refuses the second request.
    let a_slot = Slot::for_key(key("a"));
    let mut same_slot = (0..)
        .map(|n| format!("s{n}"))
        .filter(|name| Slot::for_key(key(name)) == a_slot);
    let (z, c) = (same_slot.next().unwrap(), same_slot.next().unwrap());
    let [b_name, d_name] = <[String; 2]>::try_from(
        distinct_slots("xr:", "o", 3)
            .into_iter()
            .filter(|n| Slot::for_key(key(n)) != a_slot)
            .take(2)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    let sliding = limit(Algorithm::SlidingWindow, 10, Unit::Minute);
    let request = [
        hit("a", sliding, 1),
        hit(&b_name, limit(Algorithm::FixedWindow, 1, Unit::Minute), 1),
        hit(&z, sliding, 0),
        hit(&c, sliding, 1),
        hit(&d_name, limit(Algorithm::TokenBucket, 10, Unit::Minute), 1),
    ];
    let admitted = |o: &[Outcome]| o.iter().map(|o| o.admitted).collect::<Vec<_>>();
    let remaining = async |b: &RedisBackend| {
        let mut all = Vec::new();
        for h in [&request[0], &request[3], &request[4]] {
            all.push(one(b, &hit(&h.key, h.limit, 0)).await.remaining);
        }
        all
    };
    let a_node = cluster.owner(slot_number(&cluster.nodes[0], &key("a")));
    let logged = |name: &str| a_node.query::<u64>(&["ZCARD", &key(name)]);

    assert_eq!(
        admitted(&eval(&b, &request, Charging::Atomic).await),
        [true; 5]
    );
    assert_eq!(remaining(&b).await, [9, 9, 9]);
    let refused = eval(&b, &request, Charging::Atomic).await;
    assert_eq!(admitted(&refused), [true, false, true, true, true]);
    assert_eq!(refused[0].remaining, 8, "verdicts are as if charged");
    assert_eq!(
        remaining(&b).await,
        [9, 9, 9],
        "the reservation was refunded"
    );
    assert_eq!(
        (logged("a"), logged(&c)),
        (1, 1),
        "each refund removed its own entry"
    );

    eval(&b, &request, Charging::PerDescriptor).await;
    assert_eq!(remaining(&b).await, [8, 8, 8]);
    assert_eq!((logged("a"), logged(&c)), (2, 2));
}

// ---- keys ----------------------------------------------------------------------------------

/// Requests on 3 limits of each algorithm, all in one fixed window.
async fn mixed_run(b: &RedisBackend) {
    clear_of_end(HOUR, 5 * SEC).await;
    for n in 0..5 {
        for algorithm in RATE_ALGORITHMS {
            let hits: Vec<Hit> = (0..3)
                .map(|i| {
                    hit(
                        &format!("k{i}|{algorithm}"),
                        limit(algorithm, 3, Unit::Hour),
                        n % 2 + 1,
                    )
                })
                .collect();
            b.evaluate(&hits, Charging::Atomic).await.expect("evaluate");
        }
        let permit = Hit {
            permit: Some((PermitOp::Acquire, format!("request-{n}"))),
            ..hit("permits", limit(Algorithm::Concurrency, 3, Unit::Hour), 1)
        };
        b.evaluate(&[permit], Charging::Atomic)
            .await
            .expect("evaluate");
    }
}

/// A call the batch script cannot read is refused whole, before it writes anything: the
/// well-formed request in front of the flaw is not charged either. A call it can read writes
/// counters that expire. Each row is one call's KEYS, its specs (one value; SPEC: the fixed
/// window, 10 per minute) and the ARGV after them: the count of runs of alike requests, then
/// per run its shape (ended by how many requests it holds), its requests' tickets in one value
/// (28 characters each), then per request its extra values (`lua/batch.lua` has the layout).
/// The rows run as a script and, in turn on one server, as the library's function, which
/// keeps what it read of specs and shapes: nothing a refused call read changes a later call.
#[test]
fn a_call_the_script_cannot_read_writes_nothing() {
    /// A case, its KEYS, specs, runs' values, and a word of the error it gets (None: none).
    type Malformed<'a> = (
        &'a str,
        &'a [&'a str],
        &'a str,
        &'a [&'a str],
        Option<&'a str>,
    );
    const SPEC: &str = "fixed_window 10 60 10 e;";
    let server = RedisServer::start();
    let (script, _) = turnstile::backend::redis::batch_source();
    let (library, function) = turnstile::backend::redis::batch_library();
    server.query::<String>(&["FUNCTION", "LOAD", library]);
    let (t1, t2) = (
        format!("nonce0000001{:016}", 0),
        format!("nonce0000002{:016}", 0),
    );
    let (both, long) = (format!("{t1}{t2}"), format!("{t2}0"));
    let no_deadline = format!("nonce0000002{}", "x".repeat(16));
    let (t2, both, long, no_deadline) = (
        t2.as_str(),
        both.as_str(),
        long.as_str(),
        no_deadline.as_str(),
    );
    let good = ["a 1:1*1", t1.as_str()];
    let two = ["k1", "k2"];
    #[rustfmt::skip]
    let cases: [Malformed; 21] = [
        ("well formed", &two, SPEC, &["2", good[0], good[1], "a 1:1*1", t2], None),
        ("one run of two", &two, SPEC, &["1", "a 1:1*2", both], None),
        ("a deadline that is no number", &two, SPEC, &["2", good[0], good[1], "a 1:1*1", no_deadline], None),
        ("no such mode", &two, SPEC, &["2", good[0], good[1], "x 1:1*1", t2], Some("shaped")),
        ("trailing text", &two, SPEC, &["2", good[0], good[1], "a 1:1 junk*1", t2], Some("shaped")),
        ("text after the size", &two, SPEC, &["2", good[0], good[1], "a 1:1*1 junk", t2], Some("shaped")),
        ("no size", &two, SPEC, &["2", good[0], good[1], "a 1:1", t2], Some("shaped")),
        ("a run of none", &two, SPEC, &["2", good[0], good[1], "a 1:1*0", ""], Some("no request")),
        ("no such spec", &two, SPEC, &["2", good[0], good[1], "a 2:1*1", t2], Some("spec")),
        ("no tickets", &two, SPEC, &["2", good[0], good[1], "a 1:1*1"], Some("tickets")),
        ("a run longer than its tickets", &two, SPEC, &["1", "a 1:1*3", both], Some("tickets")),
        ("a ticket too long", &two, SPEC, &["2", good[0], good[1], "a 1:1*1", long], Some("tickets")),
        ("a key too many", &["k1", "k2", "k3"], SPEC, &["2", good[0], good[1], "a 1:1*1", t2], Some("keys")),
        ("a value too many", &two, SPEC, &["2", good[0], good[1], "a 1:1*1", t2, "+r"], Some("values")),
        ("a permit missing", &two, SPEC, &["2", good[0], good[1], "a 1:1P*1", t2], Some("values")),
        ("a spec not ended", &two, "fixed_window 10 60 10 e", &["1", "a 1:1*2", both], Some("specs")),
        ("text after the specs", &two, "fixed_window 10 60 10 e;x", &["1", "a 1:1*2", both], Some("specs")),
        ("a spec short of a value", &two, "fixed_window 10 60 e;", &["1", "a 1:1*2", both], Some("specs")),
        ("no such algorithm", &two, "leaky_bucket 10 60 10 e;", &["1", "a 1:1*2", both], Some("leaky_bucket")),
        ("no specs", &two, "", &["1", "a 1:1*2", both], Some("spec")),
        ("well formed, after them all", &two, SPEC, &["1", "a 1:1*2", both], None),
    ];
    for (verb, name) in [("EVAL", script), ("FCALL", function)] {
        for (case, keys, specs, runs, error) in cases {
            server.query::<()>(&["FLUSHALL"]);
            let mut args = vec![verb, name];
            let count = keys.len().to_string();
            args.push(&count);
            args.extend(keys);
            args.extend(["0", "0", specs]);
            args.extend(runs);
            let reply = server.try_query::<Vec<i64>>(&args);
            let written: i64 = server.query(&["DBSIZE"]);
            match error {
                None => {
                    let reply = reply.unwrap_or_else(|err| panic!("{verb} {case}: {err}"));
                    // Per request: remaining 9, a reset; then the script's time.
                    assert_eq!(reply.len(), 2 * 2 + 1, "{verb} {case}: {reply:?}");
                    assert_eq!([reply[0], reply[2]], [9, 9], "{verb} {case}");
                    assert_eq!(written, 2, "{verb} {case}: one counter per key");
                    for key in server.keys("*") {
                        let ttl: i64 = server.query(&["PTTL", &key]);
                        assert!(ttl > 0, "{verb} {case}: {key} expires ({ttl})");
                    }
                }
                Some(words) => {
                    let err = reply.expect_err(case).to_string();
                    assert!(err.contains(words), "{verb} {case}: {err}");
                    assert_eq!(written, 0, "{verb} {case}: nothing is written");
                }
            }
        }
    }
}

/// What the library keeps of the specs and shapes calls send is bounded, whatever they send:
/// every request here has a cost of its own, so a shape of its own, as a client's
/// `hits_addend` can make them; Redis' memory for functions stays within a bound that keeping
/// them all would pass several times over.
#[test]
fn what_the_library_keeps_of_calls_is_bounded() {
    let server = RedisServer::start();
    let (library, function) = turnstile::backend::redis::batch_library();
    server.query::<String>(&["FUNCTION", "LOAD", library]);
    let ticket = format!("nonce0000001{:016}", 0);
    let mut connection = server.connection().expect("connect");
    let calls = 20_000;
    for chunk in (1..=calls).collect::<Vec<u32>>().chunks(1_000) {
        let mut pipe = redis::pipe();
        for cost in chunk {
            pipe.cmd("FCALL")
                .arg(function)
                .arg(1)
                .arg("k")
                .arg(0)
                .arg(0)
                .arg("fixed_window 1000000000 60 1000000000 e;")
                .arg(1)
                .arg(format!("a 1:{cost}*1"))
                .arg(&ticket)
                .ignore();
        }
        pipe.query::<()>(&mut connection).expect("calls");
    }
    // Calls that straddle a minute's end charge two windows' counters.
    let charged: u64 = server
        .keys("k:*")
        .iter()
        .map(|key| server.query::<u64>(&["GET", key]))
        .sum();
    assert_eq!(
        charged,
        u64::from(calls) * u64::from(calls + 1) / 2,
        "each call charged"
    );
    let lua_memory: u64 = server
        .info("memory", "used_memory_vm_functions")
        .and_then(|bytes| bytes.parse().ok())
        .expect("Redis 7 tells its functions' memory");
    // 20 000 shapes kept would take several MB; the bound keeps about 256 of them.
    assert!(lua_memory < 2 << 20, "functions' memory {lua_memory} bytes");
}

/// In a call that starts past its earliest deadline, each request is read against its own:
/// one past it gets a nil and charges nothing, one with none or a later one is decided.
#[test]
fn a_call_started_late_decides_only_the_requests_still_awaited() {
    let server = RedisServer::start();
    let (script, _) = turnstile::backend::redis::batch_source();
    // Decided at 10^15 µs; the first request's deadline, 5 µs, is long past.
    let now = "1000000000000000";
    #[rustfmt::skip]
    let args = [
        "EVAL", script, "3", "k1", "k2", "k3",
        now, "5", "fixed_window 10 60 10 e;",
        "1", "a 1:1*3",
        // Three tickets: a nonce, then a deadline of 16 digits (0: none).
        "nonce00000010000000000000005nonce00000020000000000000000nonce00000032000000000000000",
    ];
    let reply: Vec<Option<i64>> = server.query(&args);
    let decided: Vec<Option<i64>> = [reply[1], reply[3]].to_vec();
    assert_eq!(reply.len(), 1 + 2 * 2 + 1, "{reply:?}");
    assert_eq!(reply[0], None, "past its deadline: {reply:?}");
    assert_eq!(decided, [Some(9), Some(9)], "{reply:?}");
    assert_eq!(reply.last(), Some(&Some(now.parse().unwrap())));
    let mut counters = server.keys("*");
    counters.sort();
    assert_eq!(counters, ["k2:999999960", "k3:999999960"]);
}

#[tokio::test]
async fn every_key_expires() {
    let server = RedisServer::start();
    mixed_run(&single(&server, "ttl:").await).await;
    let keys = server.keys("ttl:*");
    // 3 limits of each rate algorithm: fixed has one counter, sliding a log and a sum, bucket
    // one; and the concurrency limit's set of permits.
    assert_eq!(keys.len(), 3 * 4 + 1, "{keys:?}");
    for key in keys {
        let ttl: i64 = server.query(&["PTTL", &key]);
        // An hour's window, plus at most a minute's spread for fixed-window counters.
        assert!(ttl > 0 && ttl <= 3_660_001, "{key}: PTTL {ttl}");
    }
}

/// A fixed window's counters do not all expire at its end, which stalls Redis (its expire
/// cycle deletes them 25 ms at a time), even when they were all made at once, as a busy
/// limit's are at each window's start: each outlives the window by a random offset below the
/// spread, the window or a minute, whichever is shorter. Each row is a window; its counters
/// are made by requests sent together.
#[tokio::test]
async fn fixed_window_counters_expire_spread_after_their_window() {
    const COUNTERS: usize = 50;
    let server = RedisServer::start();
    let b = single(&server, "spread:").await;
    for (unit, spread_ms) in [
        (Unit::Second, 1_000),
        (Unit::Minute, 60_000),
        (Unit::Hour, 60_000),
    ] {
        let window_ms = unit.seconds() * 1000;
        clear_of_end(Duration::from_millis(window_ms), Duration::from_millis(500)).await;
        // The window the counters are made in: half a second is ample to make them all.
        let window_end = (now_us() / 1000 / window_ms + 1) * window_ms;
        let hits: Vec<Hit> = (0..COUNTERS)
            .map(|n| {
                hit(
                    &format!("{unit:?}-{n}"),
                    limit(Algorithm::FixedWindow, 5, unit),
                    1,
                )
            })
            .collect();
        let outcomes = futures_util::future::join_all(hits.iter().map(|h| one(&b, h))).await;
        assert!(outcomes.iter().all(|o| o.admitted));
        let keys = server.keys(&format!("spread:{{{unit:?}-*"));
        assert_eq!(keys.len(), COUNTERS, "{keys:?}");
        let offsets: Vec<i64> = keys
            .iter()
            .map(|key| server.query::<i64>(&["PEXPIRETIME", key]) - window_end as i64)
            .collect();
        let (first, last) = (offsets.iter().min(), offsets.iter().max());
        let (first, last) = (*first.unwrap(), *last.unwrap());
        // Fifty offsets drawn evenly below the spread span less than half of it about once in
        // 10^13.
        assert!(
            first >= 0 && last <= spread_ms && last - first >= spread_ms / 2,
            "{unit:?}: offsets from {first} to {last} ms"
        );
    }
}

#[tokio::test]
async fn cluster_keys_expire_and_share_their_limits_slot() {
    let cluster = RedisCluster::shared();
    mixed_run(&clustered(&cluster, "cttl:").await).await;
    let keys = cluster.keys("cttl:*");
    assert_eq!(keys.len(), 3 * 4 + 1);
    let nodes_used: std::collections::HashSet<u16> = keys.iter().map(|(_, n)| n.port()).collect();
    assert!(nodes_used.len() > 1, "the limits spread over the Cluster");
    let mut slots_by_limit: BTreeMap<String, Vec<u16>> = BTreeMap::new();
    for (key, node) in &keys {
        let ttl: i64 = node.query(&["PTTL", key]);
        assert!(ttl > 0, "{key}: PTTL {ttl}");
        let tag = key[key.find('{').unwrap()..=key.find('}').unwrap()].to_string();
        slots_by_limit
            .entry(tag)
            .or_default()
            .push(slot_number(node, key));
    }
    assert_eq!(slots_by_limit.len(), 10);
    for (tag, slots) in slots_by_limit {
        assert!(
            slots.windows(2).all(|w| w[0] == w[1]),
            "{tag}: slots {slots:?}"
        );
    }
}

/// Limits whose identities are long (a descriptor value of 4 000 bytes) count as any other,
/// each apart from one that differs only at its end, on short keys in one slot per limit.
#[tokio::test]
async fn long_identities_count_on_short_keys_in_their_limits_slot() {
    let cluster = RedisCluster::shared();
    let b = clustered(&cluster, "long:").await;
    let padding = "x".repeat(4_000);
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::TokenBucket,
    ] {
        let hit = |end: &str| {
            hit(
                &format!("d|user={padding}{end}|{}:3600", algorithm.name()),
                limit(algorithm, 2, Unit::Hour),
                1,
            )
        };
        let remaining = [
            one(&b, &hit("a")).await.remaining,
            one(&b, &hit("a")).await.remaining,
            one(&b, &hit("b")).await.remaining,
        ];
        assert_eq!(remaining, [1, 0, 1], "{algorithm:?}");
    }
    let keys = cluster.keys("long:*");
    assert!(keys.len() >= 6, "{} keys", keys.len());
    let mut slots_by_limit: BTreeMap<String, Vec<u16>> = BTreeMap::new();
    for (key, node) in &keys {
        assert!(key.len() <= 160, "{key}");
        let tag = key[..=key.find('}').unwrap()].to_string();
        slots_by_limit
            .entry(tag)
            .or_default()
            .push(slot_number(node, key));
    }
    assert_eq!(slots_by_limit.len(), 6, "{slots_by_limit:?}");
    for (tag, slots) in slots_by_limit {
        assert!(
            slots.windows(2).all(|w| w[0] == w[1]),
            "{tag}: slots {slots:?}"
        );
    }
}

// ---- resilience ----------------------------------------------------------------------------

/// Requests while the server's script and function caches are flushed every 10 of them: none
/// may fail, and the batch script is back in the cache turnstile uses (`used`) after.
async fn survive_cache_flushes(b: &RedisBackend, servers: &[&RedisServer], used: &str) {
    let k = hit("k", limit(Algorithm::SlidingWindow, 1000, Unit::Minute), 1);
    let other = hit("k-2", limit(Algorithm::FixedWindow, 1000, Unit::Minute), 1);
    for n in 0..60 {
        if n % 10 == 0 {
            for server in servers {
                for (cache, field) in [("SCRIPT", SCRIPTS), ("FUNCTION", LIBRARIES)] {
                    let _: () = server.query(&[cache, "FLUSH"]);
                    assert_eq!(cached(server, field), 0);
                }
            }
        }
        let outcomes = b
            .evaluate(&[k.clone(), other.clone()], Charging::Atomic)
            .await
            .unwrap_or_else(|e| panic!("request {n} failed after a flush: {e}"));
        assert_eq!(outcomes[0].remaining, 999 - n, "request {n}");
    }
    assert!(
        servers.iter().any(|s| cached(s, used) > 0),
        "the batch script is back in {used}"
    );
}

/// Rows: one server, which runs the batch script as a function; one without functions (as
/// before Redis 7: `FCALL` renamed away), which runs it by hash; and a Cluster of its own (on
/// the shared one, other tests would load the script between a flush and the request that
/// must find it gone).
#[tokio::test]
async fn a_flushed_script_or_function_cache_fails_no_request() {
    let server = RedisServer::start();
    survive_cache_flushes(&single(&server, "fl:").await, &[&server], LIBRARIES).await;
    let old = RedisServer::start_with("rename-command FCALL \"\"");
    survive_cache_flushes(&single(&old, "fl:").await, &[&old], SCRIPTS).await;
    assert_eq!(old.calls(&["fcall"]), 0);
    let cluster = RedisCluster::start(3);
    let b = clustered(&cluster, "cfl:").await;
    let nodes: Vec<&RedisServer> = cluster.nodes.iter().collect();
    survive_cache_flushes(&b, &nodes, LIBRARIES).await;
}

/// A function library keeps the twins between calls, and what a call leaves in them: the fixed
/// window remembers the counter it last charged, to charge it again without reading it. A
/// call that an error ends (a counter of the wrong type) must leave nothing to the next, which
/// reads the counter afresh: here another instance has counted it meanwhile.
#[tokio::test]
async fn a_call_an_error_ended_leaves_nothing_to_the_next() {
    let server = RedisServer::start();
    let b = single(&server, "err:").await;
    let per_hour = limit(Algorithm::FixedWindow, 100, Unit::Hour);
    let (k, w) = (hit("k", per_hour, 1), hit("w", per_hour, 1));
    assert_eq!(one(&b, &k).await.remaining, 99);
    assert_eq!(one(&b, &w).await.remaining, 99);
    let counter = |name: &str| {
        let found: Vec<String> = server.query(&["KEYS", &format!("err:{{{name}}}:*")]);
        assert_eq!(found.len(), 1, "{name}'s counter: {found:?}");
        found[0].clone()
    };
    let (kc, wc) = (counter("k"), counter("w"));
    let _: () = server.query(&["DEL", &wc]);
    let _: () = server.query(&["HSET", &wc, "not", "a counter"]);
    // Charges k's counter, then fails on w's.
    let failed = b.evaluate(&[k.clone(), w], Charging::Atomic).await;
    assert!(
        matches!(&failed, Err(BackendError::Unavailable(m)) if m.contains("WRONGTYPE")),
        "{failed:?}"
    );
    let _: () = server.query(&["SET", &kc, "50"]);
    assert_eq!(one(&b, &k).await.remaining, 49);
    assert_eq!(server.query::<u64>(&["GET", &kc]), 51);
    assert!(
        cached(&server, LIBRARIES) > 0,
        "decided by the function library"
    );
}

/// A server without functions runs the batch script by hash, from the first answer that says
/// so: rows, one without `FCALL` (as before Redis 7), one with `FCALL` but no `FUNCTION` to
/// load the library with (whose first `FCALL` finds no function).
#[tokio::test]
async fn a_server_without_functions_runs_the_script_by_hash() {
    for (missing, fcalls) in [("FCALL", 0), ("FUNCTION", 1)] {
        let server = RedisServer::start_with(&format!("rename-command {missing} \"\""));
        let b = single(&server, "nf:").await;
        let k = hit("k", limit(Algorithm::FixedWindow, 10, Unit::Minute), 1);
        clear_of_end(MINUTE, CALLS_SPAN).await;
        for n in 0..3 {
            assert_eq!(one(&b, &k).await.remaining, 9 - n, "without {missing}");
        }
        assert_eq!(server.calls(&["fcall"]), fcalls, "without {missing}");
        assert!(cached(&server, SCRIPTS) > 0, "without {missing}");
    }
}

#[tokio::test]
async fn a_frozen_server_times_out_within_the_call_timeout_and_recovers() {
    let server = RedisServer::start();
    let b = RedisBackend::connect(&RedisConfig {
        call_timeout: Duration::from_millis(200),
        ..config(vec![server.url()], RedisMode::Single, "fz:")
    })
    .await
    .unwrap();
    let k = hit("k", limit(Algorithm::FixedWindow, 10, Unit::Minute), 1);
    assert!(b.ready().await);
    assert!(one(&b, &k).await.admitted);

    server.freeze();
    let start = Instant::now();
    let frozen = b.evaluate(std::slice::from_ref(&k), Charging::Atomic).await;
    let waited = start.elapsed();
    let ready = b.ready().await;
    server.thaw();
    assert_eq!(frozen, Err(BackendError::Timeout));
    assert!(
        waited >= Duration::from_millis(200) && waited < SEC,
        "{waited:?}"
    );
    assert!(!ready, "a frozen server is not ready");

    assert!(b.ready().await);
    assert!(one(&b, &k).await.admitted);
}

/// A decision whose caller's deadline has passed when the script starts (on Redis' clock,
/// learned from the earlier replies) is not taken: the answer is late and charges nothing,
/// on every algorithm, on a single server and on a Cluster (one slot, and across slots).
#[tokio::test]
async fn a_decision_past_its_callers_deadline_charges_nothing() {
    let server = RedisServer::start();
    let cluster = RedisCluster::shared();
    let single = single(&server, "late:").await;
    let clustered = clustered(&cluster, "late:").await;
    clear_of_end(HOUR, Duration::from_secs(5)).await;
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::TokenBucket,
    ] {
        let l = limit(algorithm, 10, Unit::Hour);
        let rows: [(&str, &RedisBackend, Vec<Hit>); 3] = [
            (
                "single",
                &single,
                vec![hit(&format!("s-{algorithm:?}"), l, 1)],
            ),
            (
                "cluster",
                &clustered,
                vec![hit(&format!("c-{algorithm:?}"), l, 1)],
            ),
            (
                "cluster across slots",
                &clustered,
                distinct_slots("late:", &format!("x-{algorithm:?}"), 2)
                    .iter()
                    .map(|k| hit(k, l, 1))
                    .collect(),
            ),
        ];
        for (name, backend, hits) in rows {
            let first = eval(backend, &hits, Charging::Atomic).await;
            assert!(
                first.iter().all(|o| o.admitted && o.remaining == 9),
                "{name}"
            );
            // Well in the past: the clock estimate errs late by up to the fastest reply's
            // time to reach Redis (the first reply also carried a script load).
            let gone = Instant::now() - SEC;
            let late = Deadline::at(gone).scope(backend.evaluate(&hits, Charging::Atomic));
            assert_eq!(late.await, Err(BackendError::Late), "{name} {algorithm:?}");
            let after = eval(backend, &hits, Charging::Atomic).await;
            assert!(
                after.iter().all(|o| o.admitted && o.remaining == 8),
                "{name} {algorithm:?}: the late decision charged nothing: {after:?}"
            );
        }
    }
}

#[tokio::test]
async fn a_restarted_server_is_reconnected_and_gets_the_function_library_again() {
    let mut server = RedisServer::start();
    let b = single(&server, "rs:").await;
    let k = hit("k", limit(Algorithm::TokenBucket, 10, Unit::Minute), 1);
    assert_eq!(one(&b, &k).await.remaining, 9);
    assert_eq!(one(&b, &k).await.remaining, 8);

    server.stop();
    let gone = b.evaluate(std::slice::from_ref(&k), Charging::Atomic).await;
    assert!(
        matches!(gone, Err(BackendError::Unavailable(_))),
        "a stopped server: {gone:?}"
    );
    assert!(!b.ready().await);
    server.restart();
    let deadline = Instant::now() + 10 * SEC;
    let outcome = loop {
        match b.evaluate(std::slice::from_ref(&k), Charging::Atomic).await {
            Ok(outcomes) => break outcomes[0],
            Err(e) => assert!(Instant::now() < deadline, "not back after a restart: {e}"),
        }
        sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(outcome.remaining, 9, "a fresh server (nothing persisted)");
    assert!(cached(&server, LIBRARIES) > 0);
}

#[tokio::test]
async fn connect_reports_bad_configurations() {
    let server = RedisServer::start();
    // A bare host:port is a redis:// URL.
    let bare = RedisBackend::connect(&config(vec![server.addr()], RedisMode::Single, "")).await;
    assert!(bare.expect("bare host:port").ready().await);

    let unreachable = {
        let gone = RedisServer::start();
        gone.url()
    };
    let start = Instant::now();
    let refused = RedisBackend::connect(&config(vec![unreachable], RedisMode::Single, "")).await;
    assert!(matches!(refused, Err(BackendError::Unavailable(_))));
    assert!(start.elapsed() < 3 * SEC);

    let braces =
        RedisBackend::connect(&config(vec![server.url()], RedisMode::Single, "a{b}:")).await;
    assert!(matches!(braces, Err(BackendError::Unavailable(m)) if m.contains("brace")));
    let two = RedisBackend::connect(&config(
        vec![server.url(), server.url()],
        RedisMode::Single,
        "",
    ))
    .await;
    assert!(
        matches!(&two, Err(BackendError::Unavailable(m)) if m.contains("exactly one URL")),
        "single mode takes one URL: {:?}",
        two.err()
    );
    let secured = RedisServer::start_with("requirepass sesame\n");
    let wrong_password = format!("redis://:nope@{}", secured.addr());
    let denied = RedisBackend::connect(&config(vec![wrong_password], RedisMode::Single, "")).await;
    assert!(matches!(denied, Err(BackendError::Unavailable(_))));
    let allowed = RedisBackend::connect(&config(
        vec![format!("redis://:sesame@{}/3", secured.addr())],
        RedisMode::Single,
        "",
    ))
    .await
    .expect("password and database from the URL");
    one(
        &allowed,
        &hit("k", limit(Algorithm::FixedWindow, 1, Unit::Minute), 1),
    )
    .await;
    let in_db3: u64 = {
        let mut c = redis::Client::open(format!("redis://:sesame@{}/3", secured.addr()))
            .unwrap()
            .get_connection()
            .unwrap();
        redis::cmd("DBSIZE").query(&mut c).unwrap()
    };
    assert_eq!(in_db3, 1);
}

/// Keys and values in database `db` of `server`.
fn db_state(server: &RedisServer, db: u8) -> Vec<(String, u64)> {
    let url = format!("{}/{db}", server.url());
    let mut c = redis::Client::open(url).unwrap().get_connection().unwrap();
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut c).unwrap();
    keys.into_iter()
        .map(|k| {
            let v = redis::cmd("GET").arg(&k).query(&mut c).unwrap();
            (k, v)
        })
        .collect()
}

#[tokio::test]
async fn sentinel_mode_finds_the_master_and_follows_a_failover() {
    let master = RedisServer::start();
    let replica = RedisServer::start_replica(&master);
    // A Sentinel started after the replica is in sync sees it at once (else at its next poll).
    replica.wait_until(10 * SEC, "replica in sync", |r| {
        r.query::<String>(&["INFO", "replication"])
            .contains("master_link_status:up")
    });
    let sentinel = RedisServer::start_sentinel(&master, "turnstile");
    let b = RedisBackend::connect(&RedisConfig {
        call_timeout: Duration::from_millis(500),
        ..config(
            // The database applies to the master, not to the Sentinel.
            vec![format!("{}/2", sentinel.url())],
            RedisMode::Sentinel {
                master: "turnstile".into(),
            },
            "sn:",
        )
    })
    .await
    .expect("connect through the sentinel");
    let k = hit("k", limit(Algorithm::FixedWindow, 100, Unit::Hour), 1);
    // One hour's counter is followed from the first call through the failover (at most 16 s).
    clear_of_end(HOUR, 30 * SEC).await;
    assert_eq!(one(&b, &k).await.remaining, 99);
    let state = db_state(&master, 2);
    assert_eq!(state.len(), 1, "state lives on the master, in database 2");
    assert_eq!(state[0].1, 1);
    let counter = state[0].0.clone();
    let count_on_replica = || {
        db_state(&replica, 2)
            .into_iter()
            .find(|(k, _)| *k == counter)
            .map(|(_, v)| v)
    };

    // The sentinel refuses to fail over until it has talked to the replica.
    sentinel.wait_until(10 * SEC, "sentinel accepts a failover", |s| {
        s.try_query::<()>(&["SENTINEL", "FAILOVER", "turnstile"])
            .is_ok()
    });

    // The old master keeps accepting writes until the Sentinel demotes it, seconds later:
    // the backend must move on before that, when the Sentinel names the new master.
    let deadline = Instant::now() + 6 * SEC;
    loop {
        let role: Vec<redis::Value> = replica.query(&["ROLE"]);
        let promoted = role.first() == Some(&redis::Value::BulkString(b"master".to_vec()));
        if promoted
            && let Ok(outcomes) = b.evaluate(std::slice::from_ref(&k), Charging::Atomic).await
            && count_on_replica() == Some(100 - u64::from(outcomes[0].remaining))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the backend did not follow the failover"
        );
        sleep(Duration::from_millis(50)).await;
    }
    // From now on every request goes to the new master.
    for _ in 0..5 {
        let before = count_on_replica().unwrap();
        one(&b, &k).await;
        assert_eq!(count_on_replica(), Some(before + 1));
    }
}

// ---- over-limit cache ----------------------------------------------------------------------

#[tokio::test]
async fn the_over_limit_cache_refuses_locally_but_never_beyond_what_redis_refuses() {
    use std::sync::Arc;
    use turnstile::backend::overlimit_cache::OverLimitCache;
    use turnstile::ops::metrics::Metrics;

    let server = RedisServer::start();
    let metrics = Arc::new(Metrics::new(0.8, 100));
    let cache = OverLimitCache::new(single(&server, "").await, 1_000, metrics.clone());
    let one_per_hour = limit(Algorithm::FixedWindow, 1, Unit::Hour);
    let hot = hit("hot", one_per_hour, 1);
    clear_of_end(HOUR, Duration::from_secs(5)).await;
    assert!(one(&cache, &hot).await.admitted);
    let refused = one(&cache, &hot).await;
    assert!(!refused.admitted, "Redis refuses the second hit");

    let calls = server.script_calls();
    for _ in 0..20 {
        let cached = one(&cache, &hot).await;
        assert!(!cached.admitted);
        assert!(cached.reset_after <= refused.reset_after);
    }
    assert_eq!(
        server.script_calls(),
        calls,
        "refused locally: no round trip"
    );

    // Reads, and a raised limit (a reload or a request override), still reach Redis.
    let read = one(&cache, &hit("hot", one_per_hour, 0)).await;
    assert!(read.admitted, "a read at the limit is not over it");
    let raised = one(
        &cache,
        &hit("hot", limit(Algorithm::FixedWindow, 5, Unit::Hour), 1),
    )
    .await;
    assert_eq!((raised.admitted, raised.remaining), (true, 3));
    assert_eq!(server.script_calls(), calls + 2);

    // A request that the cache refuses is answered without a round trip and charges nothing
    // on its other hits.
    let other = hit("other", limit(Algorithm::FixedWindow, 10, Unit::Hour), 1);
    assert_eq!(one(&cache, &other).await.remaining, 9);
    let calls = server.script_calls();
    let both = eval(&cache, &[other.clone(), hot.clone()], Charging::Atomic).await;
    assert_eq!((both[0].admitted, both[1].admitted), (true, false));
    assert_eq!(server.script_calls(), calls, "refused at once");
    assert_eq!(
        one(&cache, &other).await.remaining,
        8,
        "the refused request charged nothing"
    );
    assert!(metrics.render().contains("turnstile_local_cache_hits 21"));
}

// ---- TLS ----------------------------------------------------------------------------------

/// A private CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files in
/// a temporary directory.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

        // Distinct names: OpenSSL takes a certificate whose subject is its issuer's for a
        // self-signed one.
        let params = |names: Vec<String>, common_name: &str| {
            let mut params = CertificateParams::new(names).unwrap();
            params
                .distinguished_name
                .push(DnType::CommonName, common_name);
            params
        };
        let mut ca_params = params(Vec::new(), "turnstile test CA");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, pem: &str| std::fs::write(dir.path().join(name), pem).unwrap();
        for (name, file) in [("127.0.0.1", "server"), ("turnstile", "client")] {
            let key = KeyPair::generate().unwrap();
            let cert = params(vec![name.to_owned()], name)
                .signed_by(&key, &ca)
                .unwrap();
            write(&format!("{file}.pem"), &cert.pem());
            write(&format!("{file}.key"), &key.serialize_pem());
        }
        write("ca.pem", &ca.pem());
        Pki { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    fn pem(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.path().join(name)).unwrap()
    }

    /// `redis.conf` lines: a TLS port (see `RedisServer::tls_port`) that requires a client
    /// certificate signed by this CA.
    fn redis_config(&self) -> String {
        format!(
            "tls-port {{tls-port}}\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\ntls-auth-clients yes\n",
            self.path("server.pem"),
            self.path("server.key"),
            self.path("ca.pem"),
        )
    }
}

/// A Redis server with a TLS port that requires a client certificate (plain `server` stays
/// reachable for checks).
struct TlsRedis {
    server: RedisServer,
    pki: Pki,
}

impl TlsRedis {
    fn start() -> TlsRedis {
        let pki = Pki::new();
        let server = RedisServer::start_with(&pki.redis_config());
        TlsRedis { server, pki }
    }
}

#[tokio::test]
async fn tls_with_a_private_ca_and_a_client_certificate() {
    use turnstile::backend::redis::RedisTls;

    let tls = TlsRedis::start();
    let url = format!("rediss://127.0.0.1:{}", tls.server.tls_port());
    let with = |tls: RedisTls| RedisConfig {
        tls,
        ..config(vec![url.clone()], RedisMode::Single, "")
    };

    let full = with(RedisTls {
        ca: Some(tls.pki.pem("ca.pem")),
        client: Some((tls.pki.pem("client.pem"), tls.pki.pem("client.key"))),
    });
    let backend = RedisBackend::connect(&full)
        .await
        .expect("TLS with a client certificate");
    let h = hit("tls", limit(Algorithm::TokenBucket, 5, Unit::Minute), 1);
    assert_eq!(one(&backend, &h).await.remaining, 4);

    let no_client_cert = with(RedisTls {
        ca: Some(tls.pki.pem("ca.pem")),
        client: None,
    });
    let refused = RedisBackend::connect(&no_client_cert).await.err();
    assert!(
        matches!(&refused, Some(BackendError::Unavailable(m)) if m.contains("CertificateRequired")),
        "the server requires a client certificate: {refused:?}"
    );
    let system_roots = with(RedisTls::default());
    let refused = RedisBackend::connect(&system_roots).await.err();
    assert!(
        matches!(&refused, Some(BackendError::Unavailable(m)) if m.contains("UnknownIssuer")),
        "a private CA is not trusted by default: {refused:?}"
    );
}

// ---- the reference's variables -------------------------------------------------------------

#[tokio::test]
async fn redis_auth_applies_to_urls_without_credentials() {
    let server = RedisServer::start_with("requirepass s3cret\nuser alice on >pw ~* +@all\n");
    let bare = server.addr();
    let with_auth = |auth: &str| RedisConfig {
        auth: Some(auth.into()),
        ..config(vec![bare.clone()], RedisMode::Single, "")
    };
    let h = hit("auth", limit(Algorithm::FixedWindow, 5, Unit::Hour), 1);
    let backend = RedisBackend::connect(&with_auth("s3cret"))
        .await
        .expect("password");
    assert!(one(&backend, &h).await.admitted);
    let backend = RedisBackend::connect(&with_auth("alice:pw"))
        .await
        .expect("user:password");
    assert!(one(&backend, &h).await.admitted);
    let wrong = RedisBackend::connect(&with_auth("wrong")).await.err();
    assert!(
        matches!(&wrong, Some(BackendError::Unavailable(m)) if m.contains("AuthenticationFailed")),
        "a wrong password: {wrong:?}"
    );
    let none = RedisBackend::connect(&config(vec![bare.clone()], RedisMode::Single, ""))
        .await
        .err();
    assert!(
        matches!(&none, Some(BackendError::Unavailable(m)) if m.contains("NOAUTH")),
        "no credentials, no access: {none:?}"
    );
}

#[tokio::test]
async fn a_redis_url_without_a_backend_type_means_the_redis_backend() {
    use support::turnstile::{Rules, Turnstile, descriptor, request};
    let server = RedisServer::start();
    let rules = Rules::new(FIVE_AN_HOUR);
    let url = server.url();
    let t = Turnstile::start_with(
        &["--config", rules.path().to_str().unwrap()],
        &[
            ("REDIS_URL", url.as_str()),
            ("TURNSTILE_REDIS_TIMEOUT", "2s"),
        ],
    )
    .await;
    let answer = t
        .call(request("d", vec![descriptor(&[("k", "v")])]))
        .await
        .unwrap();
    assert_eq!(answer.statuses[0].limit_remaining, 4);
    assert!(!server.keys("*").is_empty(), "the count lives in Redis");
}

/// Keys in database 0 of the Redis at `url` (credentials in the URL).
fn keys_at(url: &str) -> Vec<String> {
    let mut c = redis::Client::open(url).unwrap().get_connection().unwrap();
    redis::cmd("KEYS").arg("*").query(&mut c).unwrap()
}

/// Each row: the reference's variables naming a Redis, and plain URLs of the servers one of
/// which must then hold the state. Through the binary, so the variables' wiring is what is tested.
#[tokio::test]
async fn the_reference_redis_variables_reach_the_redis_they_name() {
    use support::turnstile::{Rules, Turnstile, descriptor, request};
    let master = RedisServer::start();
    let sentinel = RedisServer::start_sentinel(&master, "turnstile");
    let tls = TlsRedis::start();
    let secured = RedisServer::start_with("requirepass s3cret\n");
    // Nodes that talk to each other over TLS too, so a plain-text path would show up.
    let cluster_pki = Pki::new();
    let cluster = RedisCluster::start_with(
        3,
        0,
        &format!("{}tls-cluster yes\n", cluster_pki.redis_config()),
    );
    let rules = Rules::new(FIVE_AN_HOUR);
    // (what, environment, a plain URL of the server that must hold the count)
    type Row<'a> = (&'a str, Vec<(&'a str, String)>, Vec<String>);
    let rows: [Row<'_>; 4] = [
        (
            "REDIS_TYPE=sentinel, REDIS_URL=<master name>,<sentinel>",
            vec![
                ("REDIS_TYPE", "sentinel".into()),
                ("REDIS_URL", format!("turnstile,{}", sentinel.addr())),
            ],
            vec![master.url()],
        ),
        (
            "REDIS_TLS with REDIS_TLS_CACERT and a client certificate, for a bare address",
            vec![
                ("REDIS_URL", format!("127.0.0.1:{}", tls.server.tls_port())),
                ("REDIS_TLS", "true".into()),
                ("REDIS_TLS_CACERT", tls.pki.path("ca.pem")),
                ("REDIS_TLS_CLIENT_CERT", tls.pki.path("client.pem")),
                ("REDIS_TLS_CLIENT_KEY", tls.pki.path("client.key")),
            ],
            vec![tls.server.url()],
        ),
        (
            "REDIS_TYPE=cluster over TLS, with a private CA and a client certificate",
            vec![
                ("REDIS_TYPE", "cluster".into()),
                (
                    "REDIS_URL",
                    format!("rediss://127.0.0.1:{}", cluster.nodes[0].tls_port()),
                ),
                ("REDIS_TLS_CACERT", cluster_pki.path("ca.pem")),
                ("REDIS_TLS_CLIENT_CERT", cluster_pki.path("client.pem")),
                ("REDIS_TLS_CLIENT_KEY", cluster_pki.path("client.key")),
            ],
            cluster.urls(),
        ),
        (
            "REDIS_AUTH for an address without credentials",
            vec![
                ("REDIS_URL", secured.addr()),
                ("REDIS_AUTH", "s3cret".into()),
            ],
            vec![format!("redis://:s3cret@{}", secured.addr())],
        ),
    ];
    for (what, env, holders) in rows {
        let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        env.push(("TURNSTILE_REDIS_TIMEOUT", "2s"));
        let t = Turnstile::start_with(&["--config", rules.path().to_str().unwrap()], &env).await;
        for remaining in [4, 3] {
            let answer = t
                .call(request("d", vec![descriptor(&[("k", "v")])]))
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(answer.statuses[0].limit_remaining, remaining, "{what}");
        }
        let keys: usize = holders.iter().map(|url| keys_at(url).len()).sum();
        assert_eq!(keys, 1, "{what}: the count lives there");
    }
}

/// Redis down when turnstile starts: it serves at once, answers by its failure policy, and
/// decides on Redis as soon as Redis is up.
#[tokio::test]
async fn a_redis_unreachable_at_start_up_is_connected_when_it_comes_up() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use support::turnstile::{Rules, Turnstile, descriptor, request};
    let mut server = RedisServer::start();
    server.stop();
    let rules = Rules::new(FIVE_AN_HOUR);
    let url = server.url();
    let t = Turnstile::start_unhealthy(
        &[
            "--config",
            rules.path().to_str().unwrap(),
            "--redis-url",
            &url,
            "--redis-timeout",
            "2s",
            "--on-backend-error",
            "deny",
        ],
        &[],
    )
    .await;
    let (status, _) = t.http_get("/healthcheck").await.unwrap();
    assert_ne!(
        status, 200,
        "not in rotation before the backend has answered"
    );
    let call = || t.call(request("d", vec![descriptor(&[("k", "v")])]));
    let refused = call().await.expect("the policy answers, not an error");
    assert_eq!(
        refused.overall_code,
        Code::OverLimit as i32,
        "deny while Redis is down"
    );

    server.restart();
    let deadline = Instant::now() + 10 * SEC;
    loop {
        let answer = call().await.unwrap();
        if answer.overall_code == Code::Ok as i32 {
            assert_eq!(answer.statuses[0].limit_remaining, 4, "counted by Redis");
            break;
        }
        assert!(Instant::now() < deadline, "never connected to Redis");
        sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(server.keys("*").len(), 1, "the count lives in Redis");
    // Back in rotation at the next probe.
    while t.http_get("/healthcheck").await.unwrap().0 != 200 {
        assert!(Instant::now() < deadline, "never healthy");
        sleep(Duration::from_millis(100)).await;
    }
}

/// SIGTERM: health turns NOT_SERVING, new connections are refused, and a call in flight
/// (waiting on a frozen Redis) still gets its answer before the process exits 0.
#[tokio::test]
async fn sigterm_drains_calls_in_flight_and_reports_not_serving() {
    use support::turnstile::{Rules, Turnstile, descriptor, request, signal};
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let server = RedisServer::start();
    let rules = Rules::new(FIVE_AN_HOUR);
    let url = server.url();
    let mut t = Turnstile::start(
        rules.path(),
        &[
            "--redis-url",
            &url,
            "--redis-timeout",
            "10s",
            "--breaker-failures",
            "1000",
        ],
    )
    .await;
    let channel = t.channel().await;
    let mut watch = HealthClient::new(channel.clone())
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let status = |s: Option<tonic_health::pb::HealthCheckResponse>| s.map(|s| s.status);
    assert_eq!(
        status(watch.message().await.unwrap()),
        Some(ServingStatus::Serving as i32)
    );

    server.freeze();
    let in_flight = tokio::spawn({
        let mut client = envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::new(channel);
        async move {
            client
                .should_rate_limit(request("d", vec![descriptor(&[("k", "v")])]))
                .await
        }
    });
    server.written_to("the call in flight").await;
    assert!(
        !in_flight.is_finished(),
        "the call waits on the frozen Redis"
    );
    signal(t.pid(), "TERM");
    assert_eq!(
        status(watch.message().await.unwrap()),
        Some(ServingStatus::NotServing as i32),
        "health reports the shutdown"
    );
    drop(watch);
    // Health reports the shutdown first; the port closes right after.
    let closed = async {
        while tokio::net::TcpStream::connect(t.grpc).await.is_ok() {
            sleep(Duration::from_millis(10)).await;
        }
    };
    assert!(
        tokio::time::timeout(Duration::from_secs(2), closed)
            .await
            .is_ok(),
        "no new connection once stopping"
    );
    assert!(t.alive(), "the call in flight holds the process");
    server.thaw();
    let answer = in_flight
        .await
        .unwrap()
        .expect("the call in flight is answered");
    assert_eq!(answer.get_ref().statuses[0].limit_remaining, 4);
    let exit = t.terminate().await;
    assert!(exit.success(), "{exit}");
}

const EVICTS_WHEN_FULL: &str = "turnstile_redis_evicts_when_full";

/// `turnstile_redis_evicts_when_full` once turnstile has read Redis' settings (within 5 s).
async fn evicts_when_full(t: &support::turnstile::Turnstile) -> Option<f64> {
    let deadline = Instant::now() + 5 * SEC;
    loop {
        let seen = t.metric(EVICTS_WHEN_FULL).await;
        if seen.is_some() || Instant::now() > deadline {
            return seen;
        }
        sleep(Duration::from_millis(20)).await;
    }
}

/// On a Cluster every master's settings count: one under `noeviction`, whichever it is, is
/// enough for the gauge to say so.
#[tokio::test]
async fn every_cluster_master_is_asked_what_it_does_once_full() {
    use support::turnstile::{Rules, Turnstile};
    let cluster = RedisCluster::shared();
    let rules = Rules::new(FIVE_AN_HOUR);
    let urls = cluster.urls().join(",");
    let args = [
        "--redis-url",
        &urls,
        "--redis-type",
        "cluster",
        "--redis-timeout",
        "2s",
    ];
    // Rows: the master set to `noeviction` (its port), if any, and the gauge. The harness
    // starts every node bounded and evicting; the setting changes no answer below 256 MB, so
    // the other tests on this Cluster see nothing of it.
    let masters = cluster.masters();
    let mut rows = vec![(None, 1.0)];
    rows.extend(masters.iter().map(|m| (Some(m.port()), 0.0)));
    for (refusing, gauge) in rows {
        let master = masters.iter().find(|m| Some(m.port()) == refusing);
        if let Some(master) = master {
            let _: String = master.query(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
        }
        let t = Turnstile::start(rules.path(), &args).await;
        let seen = evicts_when_full(&t).await;
        if let Some(master) = master {
            let _: String = master.query(&["CONFIG", "SET", "maxmemory-policy", "volatile-lru"]);
        }
        assert_eq!(seen, Some(gauge), "noeviction on {refusing:?}");
    }
}

/// A client sending a new descriptor value with every request fills Redis with new keys.
/// Redis that evicts then makes room, and every other client is still limited; Redis under
/// `noeviction` refuses every decision, which turnstile reads from its settings and shows in
/// `turnstile_redis_evicts_when_full` (with a warning in its log).
#[tokio::test]
async fn a_flood_of_new_keys_stops_limiting_only_where_redis_does_not_evict() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use support::turnstile::{Rules, Turnstile, descriptor, request};
    let rules = Rules::new(
        "domain: d\ndescriptors:\n  - key: flood\n    rate_limit: {unit: hour, requests_per_unit: 1000000}\n  - key: steady\n    rate_limit: {unit: hour, requests_per_unit: 3}\n",
    );
    // Rows: redis.conf lines (after the harness's 256 MB, volatile-lru), the gauge, and
    // after a flood, whether another client is still limited (None: no flood).
    let rows: [(&str, Option<f64>, Option<bool>); 4] = [
        ("maxmemory 3mb\n", Some(1.0), Some(true)),
        (
            "maxmemory 3mb\nmaxmemory-policy noeviction\n",
            Some(0.0),
            Some(false),
        ),
        ("maxmemory 0\n", Some(0.0), None),
        ("rename-command CONFIG \"\"\n", None, None),
    ];
    for (lines, gauge, limited) in rows {
        let server = RedisServer::start_with(lines);
        let url = server.url();
        let t = Turnstile::start(
            rules.path(),
            &["--redis-url", &url, "--redis-timeout", "2s"],
        )
        .await;
        let steady = || request("d", vec![descriptor(&[("steady", "s")])]);
        // The backend is connected once a decision comes from Redis; its settings are read
        // right after.
        let first = t.call(steady()).await.expect("decided on Redis");
        assert_eq!(first.statuses[0].limit_remaining, 2, "{lines}");
        let seen = match gauge {
            Some(_) => evicts_when_full(&t).await,
            None => {
                sleep(Duration::from_millis(300)).await;
                t.metric(EVICTS_WHEN_FULL).await
            }
        };
        assert_eq!(seen, gauge, "{lines}");
        let Some(limited) = limited else {
            continue;
        };
        // The flood: 256 calls of 64 new values of 100 bytes each, about 16 000 keys, twice
        // what 3 MB holds.
        let channel = t.channel().await;
        let mut flood = tokio::task::JoinSet::new();
        for task in 0..8 {
            let mut client = envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::new(channel.clone());
            flood.spawn(async move {
                let mut failed = 0;
                for call in 0..32 {
                    let descriptors = (0..64)
                        .map(|i| {
                            let value = format!("{task}-{call}-{i}-{}", "x".repeat(90));
                            descriptor(&[("flood", value.as_str())])
                        })
                        .collect();
                    failed += client
                        .should_rate_limit(request("d", descriptors))
                        .await
                        .is_err() as usize;
                }
                failed
            });
        }
        let mut failed = 0;
        while let Some(done) = flood.join_next().await {
            failed += done.expect("a flood task panicked");
        }
        let evicted: u64 = server
            .info("stats", "evicted_keys")
            .and_then(|n| n.parse().ok())
            .expect("evicted_keys");
        if limited {
            assert!(evicted > 1_000, "the flood filled Redis: {evicted} evicted");
            assert_eq!(failed, 0, "every call of the flood decided");
            // One left after the flood, or three if it evicted the count: refused either way
            // by the fourth call, and every call decided.
            let mut answers = Vec::new();
            for _ in 0..4 {
                answers.push(t.call(steady()).await.map(|a| a.overall_code()));
            }
            assert!(answers.iter().all(Result::is_ok), "{answers:?}");
            assert_eq!(
                answers.last().unwrap().as_ref().ok(),
                Some(&Code::OverLimit)
            );
        } else {
            // Full, Redis refused the flood's decisions, and would refuse anyone's.
            assert_eq!(evicted, 0, "{lines}");
            let refused = server.info("errorstats", "errorstat_OOM");
            assert!(
                refused.as_deref().is_some_and(|r| r != "count=0"),
                "{refused:?}"
            );
            assert!(failed > 0, "the flood's calls failed once Redis was full");
        }
    }
}

/// The table tests/core.rs holds the memory backend to, on Redis with its over-limit cache.
#[tokio::test]
async fn the_reference_answers_where_clients_see_them() {
    use support::turnstile::{Rules, Turnstile};
    let server = RedisServer::start();
    let rules = Rules::new(support::reference::RULES);
    let url = server.url();
    let t = Turnstile::start(
        rules.path(),
        &[
            "--backend",
            "redis",
            "--redis-url",
            &url,
            "--redis-timeout",
            "2s",
        ],
    )
    .await;
    support::reference::check(&t, true).await;
}

#[tokio::test]
async fn a_unix_socket_url_reaches_redis() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("redis.sock");
    let _server = RedisServer::start_with(&format!(
        "unixsocket {}\nunixsocketperm 700\n",
        socket.display()
    ));
    let url = format!("redis+unix://{}", socket.display());
    let backend = RedisBackend::connect(&config(vec![url], RedisMode::Single, ""))
        .await
        .expect("connect over the socket");
    let h = hit("sock", limit(Algorithm::SlidingWindow, 2, Unit::Minute), 1);
    assert_eq!(one(&backend, &h).await.remaining, 1);
}

#[tokio::test]
async fn the_reference_key_layout_shares_fixed_window_counters_with_the_reference() {
    use support::turnstile::{Rules, Turnstile, descriptor, request};
    let server = RedisServer::start();
    let rules = Rules::new(
        "domain: rl\ndescriptors:\n  - key: k\n    value: v\n    descriptors:\n      - key: user\n        rate_limit: {unit: hour, requests_per_unit: 10}\n",
    );
    clear_of_end(HOUR, Duration::from_secs(10)).await;
    // What the reference writes after three hits this hour: INCRBY + EXPIRE on
    // <prefix><domain>_<key>_<value>_..._<window start>.
    let time: Vec<String> = server.query(&["TIME"]);
    let hour = time[0].parse::<u64>().unwrap() / 3_600 * 3_600;
    let key = format!("pre:rl_k_v_user_alice_{hour}");
    let _: () = server.query(&["SET", &key, "3", "EX", "3600"]);

    let url = server.url();
    let t = Turnstile::start_with(
        &[
            "--config",
            rules.path().to_str().unwrap(),
            "--key-layout",
            "reference",
        ],
        &[
            ("REDIS_URL", url.as_str()),
            ("CACHE_KEY_PREFIX", "pre:"),
            ("TURNSTILE_REDIS_TIMEOUT", "2s"),
        ],
    )
    .await;
    let answer = t
        .call(request(
            "rl",
            vec![descriptor(&[("k", "v"), ("user", "alice")])],
        ))
        .await
        .unwrap();
    assert_eq!(
        answer.statuses[0].limit_remaining, 6,
        "3 counted by the reference, 1 now"
    );
    let count: String = server.query(&["GET", &key]);
    assert_eq!(count, "4", "turnstile counted on the reference's key");
    let ttl: i64 = server.query(&["PTTL", &key]);
    assert!(ttl > 0);
}

// ---- exact retry times ---------------------------------------------------------------------

/// Refuse once, then probe (30 ms before the reported retry time, then every 2 ms) until
/// admitted. Returns how late (+) or early (-) the first admitted probe was sent, relative to
/// the reported time, in milliseconds.
///
/// The retry time counts from the refusing decision, which the client places only within that
/// call's round trip: the limit resets somewhere in [due - round trip, due], `due` being the
/// answer's arrival plus the reported wait. A probe is admitted by a decision taken before
/// its answer arrived, so what is knowable, and asserted, is that no admitted probe's answer
/// arrived before `due - round trip`; and a probe sent after `due` is decided after the reset,
/// so it must be admitted (within 1 ms: the wait is reported in whole microseconds, and timers
/// here have millisecond granularity).
async fn retry_error_ms(backend: &impl Backend, h: &Hit, fill: usize) -> f64 {
    for _ in 0..fill {
        assert!(
            one(backend, h).await.admitted,
            "the limit admits {fill} first"
        );
    }
    let sent = Instant::now();
    let refused = one(backend, h).await;
    let answered = Instant::now();
    assert!(!refused.admitted);
    let round_trip = answered - sent;
    let due = answered + refused.reset_after;
    if refused.reset_after > Duration::from_millis(60) {
        tokio::time::sleep_until((due - Duration::from_millis(30)).into()).await;
    }
    loop {
        let sent = Instant::now();
        let probe = one(backend, h).await;
        let answered = Instant::now();
        if probe.admitted {
            assert!(
                answered + round_trip >= due,
                "admitted {:?} before the reported retry time, the refusal's round trip was {round_trip:?}",
                due - answered
            );
            return if sent >= due {
                (sent - due).as_secs_f64() * 1e3
            } else {
                -((due - sent).as_secs_f64() * 1e3)
            };
        }
        assert!(
            sent < due + Duration::from_millis(1),
            "refused {:?} after the reported retry time",
            sent - due
        );
        sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test]
async fn retry_times_are_when_admission_resumes() {
    let server = RedisServer::start();
    let cluster = RedisCluster::shared();
    let memory = MemoryBackend::new(1_000, turnstile::backend::memory::DEFAULT_MAX_BYTES);
    let single = single(&server, "retry:").await;
    let clustered = clustered(&cluster, "retry:").await;
    let cases = [
        (
            "fixed_window",
            limit(Algorithm::FixedWindow, 1, Unit::Second),
            1,
        ),
        (
            "sliding_window",
            limit(Algorithm::SlidingWindow, 2, Unit::Second),
            2,
        ),
        (
            "token_bucket",
            Limit {
                burst: 1,
                ..limit(Algorithm::TokenBucket, 5, Unit::Second)
            },
            1,
        ),
    ];
    for (name, l, fill) in cases {
        let errors = [
            retry_error_ms(&memory, &hit(&format!("m-{name}"), l, 1), fill).await,
            retry_error_ms(&single, &hit(&format!("s-{name}"), l, 1), fill).await,
            retry_error_ms(&clustered, &hit(&format!("c-{name}"), l, 1), fill).await,
        ];
        println!(
            "{name}: first admission after the reported retry time (memory, single, cluster): {errors:.1?} ms"
        );
    }
}

// ---- hot-key shards ------------------------------------------------------------------------

#[tokio::test]
async fn a_sharded_limit_spreads_one_hot_key_over_cluster_nodes_and_never_exceeds_the_limit() {
    use support::turnstile::{Rules, Turnstile, descriptor, request};
    let cluster = RedisCluster::shared();
    let rules = Rules::new(
        "domain: hot\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: hour, requests_per_unit: 100, shards: 8}\n",
    );
    let urls = cluster.urls().join(",");
    let t = Turnstile::start_with(
        &["--config", rules.path().to_str().unwrap()],
        &[
            ("REDIS_URL", urls.as_str()),
            ("REDIS_TYPE", "cluster"),
            ("TURNSTILE_REDIS_TIMEOUT", "2s"),
            ("CACHE_KEY_PREFIX", "shards:"),
        ],
    )
    .await;
    clear_of_end(HOUR, Duration::from_secs(10)).await;
    let mut client = t.client().await;
    let mut admitted = 0;
    for _ in 0..400 {
        let answer = client
            .should_rate_limit(request("hot", vec![descriptor(&[("tenant", "big")])]))
            .await
            .unwrap()
            .into_inner();
        if answer.overall_code
            == envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code::Ok as i32
        {
            admitted += 1;
        }
    }
    assert!(admitted <= 100, "admitted {admitted} of 100");
    // 400 requests over 8 shards of 12 or 13: every shard is spent, barring an unlucky draw.
    assert!(admitted >= 95, "admitted only {admitted} of 100");
    let keys = cluster.keys("shards:*");
    let nodes: std::collections::HashSet<u16> = keys.iter().map(|(_, node)| node.port()).collect();
    assert!(keys.len() >= 8, "{} keys", keys.len());
    assert!(
        nodes.len() >= 2,
        "one hot key spread over {} node(s)",
        nodes.len()
    );
}

// ---- concurrency limits --------------------------------------------------------------------

/// Four turnstile instances on `server`, with a generous Redis timeout.
async fn four_instances(
    server: &RedisServer,
    rules: &support::turnstile::Rules,
) -> Vec<support::turnstile::Turnstile> {
    let extra: Vec<String> = [
        "--backend",
        "redis",
        "--redis-url",
        &server.url(),
        "--redis-timeout",
        "2s",
    ]
    .map(String::from)
    .to_vec();
    support::turnstile::Turnstile::start_all(rules.path(), &vec![extra; 4]).await
}

#[tokio::test]
async fn concurrency_limits_hold_across_four_instances_and_leases_come_back() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use support::turnstile::{Rules, descriptor, request};
    let server = RedisServer::start();
    let rules = Rules::new(
        "domain: cc\ndescriptors:\n  - key: tenant\n    descriptors:\n      - key: request_id\n        rate_limit: {algorithm: concurrency, requests_per_unit: 3, window: 2s}\n",
    );
    let instances = four_instances(&server, &rules).await;
    let mut next = 0;
    let mut call = async |id: &str, release: bool| {
        let mut r = request(
            "cc",
            vec![descriptor(&[("tenant", "t1"), ("request_id", id)])],
        );
        r.descriptors[0].is_negative_hits = release;
        next += 1;
        let answer = instances[next % 4].call(r).await.unwrap();
        (
            Code::try_from(answer.overall_code).unwrap(),
            answer.statuses[0].limit_remaining,
        )
    };
    assert_eq!(call("r1", false).await, (Code::Ok, 2));
    assert_eq!(call("r2", false).await, (Code::Ok, 1));
    assert_eq!(call("r3", false).await, (Code::Ok, 0));
    assert_eq!(
        call("r4", false).await.0,
        Code::OverLimit,
        "a fourth in flight"
    );
    assert_eq!(
        call("r2", false).await,
        (Code::Ok, 0),
        "a retry holds its own permit"
    );
    // The stream-done call of a request that was refused gives nothing back.
    assert_eq!(call("r4", true).await.0, Code::Ok);
    assert_eq!(call("r5", false).await.0, Code::OverLimit);
    // r1 is done: its place is free, on any instance.
    assert_eq!(call("r1", true).await, (Code::Ok, 1));
    assert_eq!(call("r5", false).await, (Code::Ok, 0));
    assert_eq!(call("r6", false).await.0, Code::OverLimit);
    // Lost stream-done calls: the permits expire after the window (2 s).
    sleep(Duration::from_millis(2_100)).await;
    assert_eq!(call("r6", false).await, (Code::Ok, 2));
    let keys = server.keys("*");
    assert_eq!(keys.len(), 1, "one sorted set for the tenant: {keys:?}");
    assert!(keys[0].contains("request_id=*"), "{keys:?}");
}

// ---- quota leases --------------------------------------------------------------------------

#[tokio::test]
async fn quota_leases_cut_redis_calls_and_never_exceed_the_limit_across_four_instances() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use support::turnstile::{Rules, descriptor, request};
    let server = RedisServer::start();
    let rules = Rules::new(
        "domain: lease\ndescriptors:\n  - key: fixed\n    rate_limit: {unit: hour, requests_per_unit: 200, lease: 10}\n  - key: bucket\n    rate_limit: {unit: hour, requests_per_unit: 200, algorithm: token_bucket, lease: 10}\n",
    );
    let instances = four_instances(&server, &rules).await;
    let mut clients = Vec::new();
    for t in &instances {
        clients.push(t.client().await);
    }
    clear_of_end(HOUR, Duration::from_secs(15)).await;
    for key in ["fixed", "bucket"] {
        let calls_before = server.script_calls();
        let mut admitted = 0;
        for i in 0..400 {
            let answer = clients[i % 4]
                .should_rate_limit(request("lease", vec![descriptor(&[(key, "hot")])]))
                .await
                .unwrap()
                .into_inner();
            if answer.overall_code == Code::Ok as i32 {
                admitted += 1;
            }
        }
        let calls = server.script_calls() - calls_before;
        println!(
            "{key}: 400 requests on 4 instances, limit 200, lease 10: admitted {admitted}, {calls} Redis script calls"
        );
        assert!(admitted <= 200, "{key}: admitted {admitted} of 200");
        assert!(
            admitted >= 200 - 4 * 9,
            "{key}: at most 9 units per instance may lapse, admitted {admitted}"
        );
        assert!(calls <= 120, "{key}: {calls} Redis calls for 400 requests");
    }
}

// ---- coalescing ----------------------------------------------------------------------------

/// With one call in flight (the lane's only one: one connection), requests that arrive queue
/// and share the next script call, yet each is decided on its own: a request refused by one
/// limit charges none of its hits, the request beside it in the same call is admitted and
/// charged. Redis counts two script calls for the three requests (three with `batch: 1`).
#[tokio::test]
async fn requests_queued_behind_a_call_share_the_next_one_and_decide_independently() {
    let server = RedisServer::start();
    let b = over_connections(&server, 1, "co:").await;
    let one_an_hour = limit(Algorithm::FixedWindow, 1, Unit::Hour);
    let ten_an_hour = limit(Algorithm::FixedWindow, 10, Unit::Hour);
    clear_of_end(HOUR, Duration::from_secs(10)).await;
    assert!(
        settled(&server, &b, 1, &hit("full", one_an_hour, 1))
            .await
            .admitted
    );

    let calls_before = server.script_calls();
    server.freeze();
    let busy = tokio::spawn({
        let b = b.clone();
        async move { one(&b, &hit("busy", ten_an_hour, 1)).await }
    });
    // The busy call is written (Redis, frozen, holds it); the next two requests queue.
    server.written_to("the busy call").await;
    let refused = tokio::spawn({
        let b = b.clone();
        let hits = [hit("full", one_an_hour, 1), hit("spared", ten_an_hour, 1)];
        async move { eval(&b, &hits, Charging::Atomic).await }
    });
    let admitted = tokio::spawn({
        let b = b.clone();
        async move { one(&b, &hit("charged", ten_an_hour, 1)).await }
    });
    run_the_others().await;
    server.thaw();
    let (busy, refused, admitted) = (
        busy.await.unwrap(),
        refused.await.unwrap(),
        admitted.await.unwrap(),
    );
    let calls = server.script_calls() - calls_before;
    assert_eq!(calls, 2, "3 requests, the last two in one call");
    assert!(busy.admitted && busy.remaining == 9, "{busy:?}");
    assert!(!refused[0].admitted, "the full limit refuses: {refused:?}");
    assert!(
        refused[1].admitted,
        "its other hit alone passes: {refused:?}"
    );
    assert!(admitted.admitted && admitted.remaining == 9, "{admitted:?}");

    // What Redis holds now, read at cost 0: the refused request charged nothing, the one
    // beside it exactly its unit.
    let read = |key: &str, l: Limit| hit(key, l, 0);
    let counts = eval(
        &b,
        &[
            read("full", one_an_hour),
            read("spared", ten_an_hour),
            read("charged", ten_an_hour),
            read("busy", ten_an_hour),
        ],
        Charging::Nothing,
    )
    .await;
    let remaining: Vec<u32> = counts.iter().map(|o| o.remaining).collect();
    assert_eq!(remaining, [0, 10, 9, 9]);
}

/// A thread serving gRPC runs the requests it read together one after another; the first to
/// find its lane idle does not start a call alone: the call starts once the thread has run
/// the others, and carries them all, though a second call slot is free (two connections).
/// Here the second request's task holds the thread for 100 ms first, as a long read would:
/// a call started at once would have carried the first request alone, and the second gone
/// in a call of its own.
#[tokio::test(flavor = "current_thread")]
async fn requests_a_serving_thread_runs_together_share_one_call() {
    let server = RedisServer::start();
    let b = over_connections(&server, 2, "burst:").await;
    let ten_an_hour = limit(Algorithm::FixedWindow, 10, Unit::Hour);
    clear_of_end(HOUR, Duration::from_secs(10)).await;
    // The warm call's answer comes before its I/O task looks at the lane's queue once more
    // and gives its slot back: a request queued in between would go in a call of its own.
    assert!(
        settled(&server, &b, 2, &hit("warm", ten_an_hour, 1))
            .await
            .admitted
    );

    let calls_before = server.script_calls();
    let first = tokio::spawn({
        let b = b.clone();
        async move { one(&b, &hit("first", ten_an_hour, 1)).await }
    });
    let second = tokio::spawn({
        let b = b.clone();
        async move {
            std::thread::sleep(Duration::from_millis(100));
            one(&b, &hit("second", ten_an_hour, 2)).await
        }
    });
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert!(first.admitted && first.remaining == 9, "{first:?}");
    assert!(second.admitted && second.remaining == 8, "{second:?}");
    assert_eq!(
        server.script_calls() - calls_before,
        1,
        "two requests, one call"
    );
}

/// Each thread serving gRPC (a current-thread runtime) opens connections of its own at its
/// first call, in the background (that call goes on the I/O thread's), and sends its later
/// calls on them; callers on a multi-thread runtime (the admin port) use the I/O thread's,
/// and a runtime that ends closes its own. Seen from Redis: the backend's clients in the
/// order they came, and the last command of each. All decide on the same counts.
#[test]
fn each_serving_thread_calls_on_connections_of_its_own() {
    let server = RedisServer::start();
    let build = |threads: Option<usize>| {
        let mut builder = match threads {
            Some(n) => {
                let mut builder = tokio::runtime::Builder::new_multi_thread();
                builder.worker_threads(n);
                builder
            }
            None => tokio::runtime::Builder::new_current_thread(),
        };
        builder.enable_all().build().unwrap()
    };
    let multi = build(Some(1));
    let b = multi.block_on(over_connections(&server, 2, "own:"));
    let ten_an_hour = limit(Algorithm::FixedWindow, 10, Unit::Hour);
    let k = hit("k", ten_an_hour, 1);
    // The last command of each of the backend's connections, oldest first, once they number
    // `count` (a probe connection made with each set closes soon after).
    let clients = |count: usize| -> Vec<String> {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let clients = server.clients();
            if clients.len() == count || Instant::now() > until {
                return clients.into_iter().map(|(_, cmd)| cmd).collect();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    assert_eq!(clients(2).len(), 2, "the I/O thread's");

    let serving = build(None);
    let first = serving.block_on(async {
        let first = one(&b, &k).await;
        sleep(Duration::from_millis(200)).await;
        first
    });
    assert_eq!(first.remaining, 9);
    assert_eq!(
        clients(4).len(),
        4,
        "and the serving thread's, opened at its first call"
    );
    // Round robin: one command on each connection of the I/O thread's.
    for _ in 0..2 {
        assert!(multi.block_on(b.ready()));
    }
    let later = serving.block_on(async { [one(&b, &k).await, one(&b, &k).await] });
    assert_eq!([later[0].remaining, later[1].remaining], [8, 7]);
    assert_eq!(
        clients(4),
        ["ping", "ping", "fcall", "fcall"],
        "the serving thread's calls went on its own connections"
    );

    let another = build(None);
    let third = another.block_on(async {
        let third = one(&b, &k).await;
        sleep(Duration::from_millis(200)).await;
        one(&b, &k).await.remaining.min(third.remaining)
    });
    assert_eq!(third, 5);
    assert_eq!(clients(6).len(), 6, "a second serving thread's own");
    drop(another);
    drop(serving);
    assert_eq!(clients(2).len(), 2, "an ended runtime's connections close");
}

/// A thread serving gRPC reads its own replies, so a busy one reads them late: it must not
/// blame Redis for a reply that came in time. Redis is frozen when the call is written and
/// thawed 50 ms later, while the thread is held for 300 ms (a long request); the call
/// timeout is 100 ms. The reply waits in the socket past the call's timer, and answers it.
#[tokio::test(flavor = "current_thread")]
async fn a_busy_serving_thread_does_not_blame_redis_for_a_reply_it_read_late() {
    let server = std::sync::Arc::new(RedisServer::start());
    let b = RedisBackend::connect(&RedisConfig {
        call_timeout: Duration::from_millis(100),
        ..config(vec![server.url()], RedisMode::Single, "busy:")
    })
    .await
    .unwrap();
    let k = hit("k", limit(Algorithm::FixedWindow, 10, Unit::Hour), 1);
    clear_of_end(HOUR, Duration::from_secs(10)).await;
    assert!(
        settled(&server, &b, RedisConfig::default().connections, &k)
            .await
            .admitted
    );
    assert_eq!(one(&b, &k).await.remaining, 8);

    server.freeze();
    let caller = Deadline::after(Duration::from_secs(10));
    let call = tokio::spawn(caller.scope({
        let (b, k) = (b.clone(), k.clone());
        async move { b.evaluate(&[k], Charging::Atomic).await }
    }));
    server.written_to("the call").await;
    let thaw = std::thread::spawn({
        let server = server.clone();
        move || {
            std::thread::sleep(Duration::from_millis(50));
            server.thaw();
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    thaw.join().unwrap();
    let answer = call.await.unwrap();
    assert!(
        matches!(&answer, Ok(o) if o[0].admitted && o[0].remaining == 7),
        "{answer:?}"
    );
}

/// The Redis timeout bounds a call from when it is written; the time a request queues behind
/// other calls counts only against its caller's deadline. One connection, Redis frozen: a
/// call in flight, then a request of 256 hits (a call of its own), then one of 9 (costly
/// too, so it queues behind the first in order; a light one would go ahead). Each call
/// times out in turn, and the last request, written only after more than a call timeout in
/// the queue, is answered by Redis once it thaws, instead of failing for time spent in
/// turnstile's queue. The scripts that ran late charged nothing.
#[tokio::test]
async fn queueing_counts_against_the_callers_deadline_not_the_call_timeout() {
    const TIMEOUT: Duration = Duration::from_millis(400);
    let server = RedisServer::start();
    let b = RedisBackend::connect(&RedisConfig {
        connections: 1,
        call_timeout: TIMEOUT,
        ..config(vec![server.url()], RedisMode::Single, "queue:")
    })
    .await
    .unwrap();
    let ten_an_hour = limit(Algorithm::FixedWindow, 10, Unit::Hour);
    clear_of_end(HOUR, Duration::from_secs(10)).await;
    assert!(
        settled(&server, &b, 1, &hit("warm", ten_an_hour, 1))
            .await
            .admitted
    );
    let send = |hits: Vec<Hit>| {
        let b = b.clone();
        let caller = Deadline::after(Duration::from_secs(10));
        tokio::spawn(caller.scope(async move { b.evaluate(&hits, Charging::Atomic).await }))
    };

    server.freeze();
    let first = send(vec![hit("first", ten_an_hour, 1)]);
    server.written_to("the first call").await;
    let full = send(vec![hit("full", ten_an_hour, 0); 256]);
    run_the_others().await;
    let started = Instant::now();
    let small = send(vec![hit("small", ten_an_hour, 1); 9]);
    // The first call times out at 1 timeout, the full one at 2; then the small one is sent.
    sleep(TIMEOUT * 9 / 4).await;
    server.thaw();
    let (first, full, small) = (
        first.await.unwrap(),
        full.await.unwrap(),
        small.await.unwrap(),
    );
    let waited = started.elapsed();
    assert!(matches!(first, Err(BackendError::Timeout)), "{first:?}");
    assert!(matches!(full, Err(BackendError::Timeout)), "{full:?}");
    let small = small.expect("the queued request is answered by Redis");
    assert!(small[0].admitted && small[0].remaining == 9, "{small:?}");
    assert!(waited > TIMEOUT * 3 / 2, "it waited {waited:?} in all");
    let first_now = one(&b, &hit("first", ten_an_hour, 0)).await;
    assert_eq!(first_now.remaining, 10, "{first_now:?}");
}

/// The Redis I/O thread's scheduler slice, as the kernel reports it (`se.slice` in
/// /proc/<pid>/task/<tid>/sched, in ns): 100 µs by default, what `--redis-io-slice` says, or
/// with 0 the kernel's default (the serving thread's, which turnstile leaves alone). Linux
/// takes a slice for ordinary threads from 6.12: on older kernels it reports none, and the
/// test checks that, with each flag accepted and the threads there.
#[tokio::test]
async fn the_redis_io_thread_gets_its_scheduler_slice() {
    use support::turnstile::{Rules, Turnstile};
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let version: Vec<u32> = release
        .split(|c: char| !c.is_ascii_digit())
        .take(2)
        .filter_map(|n| n.parse().ok())
        .collect();
    // Older kernels take no slice for ordinary threads: there the flag is still accepted
    // and the I/O thread still found, and no slice is reported for it.
    let slices = version >= vec![6, 12];
    let server = RedisServer::start();
    let rules = Rules::new(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
    );
    let url = server.url();
    // The slice of the process's thread named `name`, in ns.
    let slice_of = |pid: u32, name: &str| -> Option<u64> {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
        tasks.flatten().find_map(|task| {
            let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
            if comm.trim_end() != name {
                return None;
            }
            let sched = std::fs::read_to_string(task.path().join("sched")).ok()?;
            let line = sched.lines().find(|l| l.starts_with("se.slice"))?;
            line.rsplit(':').next()?.trim().parse().ok()
        })
    };
    // (flags, the slice expected: None for the serving thread's)
    for (flags, expected) in [
        (&[][..], Some(100_000)),
        (&["--redis-io-slice", "2ms"][..], Some(2_000_000)),
        (&["--redis-io-slice", "0"][..], None),
    ] {
        let mut args = vec!["--backend", "redis", "--redis-url", &url];
        args.extend_from_slice(flags);
        let t = Turnstile::start(rules.path(), &args).await;
        let pid = t.pid();
        let has_thread = |name: &str| {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .into_iter()
                .flatten()
                .flatten()
                .any(|task| {
                    std::fs::read_to_string(task.path().join("comm"))
                        .is_ok_and(|comm| comm.trim_end() == name)
                })
        };
        // Thread names are cut at 15 bytes.
        assert!(
            has_thread("turnstile-grpc-"),
            "{flags:?}: no serving thread found"
        );
        assert!(
            has_thread("turnstile-redis"),
            "{flags:?}: no Redis I/O thread found"
        );
        let expected = if slices {
            let expected = expected.or_else(|| slice_of(pid, "turnstile-grpc-"));
            assert!(
                expected.is_some(),
                "{flags:?}: no slice for the serving thread"
            );
            expected
        } else {
            None
        };
        // Set by a task on the I/O thread once the backend is made: healthy is after that,
        // but the task may run a little later.
        let until = Instant::now() + Duration::from_secs(2);
        let mut seen = slice_of(pid, "turnstile-redis");
        while seen != expected && Instant::now() < until {
            sleep(Duration::from_millis(20)).await;
            seen = slice_of(pid, "turnstile-redis");
        }
        assert_eq!(seen, expected, "{flags:?}: the I/O thread's slice in ns");
    }
}
