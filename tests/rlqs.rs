//! The Rate Limit Quota Service (RLQS): real Envoys with the `rate_limit_quota` filter
//! against real turnstile processes sharing a real Redis, and a plain gRPC client for the
//! failure cases.
//!
//! Envoy is `$ENVOY_BIN`, else `envoy` on the PATH (`scripts/test.sh` provides it); without
//! one the Envoy tests say why and are skipped, except under `CI=true`, where they fail.

mod support;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use support::raw::{RawBody, framed, raw_call, raw_connection};
use support::redis::RedisServer;
use support::turnstile::{Rules, Turnstile, free_port};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tonic::Streaming;

/// Envoy 1.40 reports every 5 s, whatever the bucket's `reporting_interval` says.
const REPORT_INTERVAL: Duration = Duration::from_secs(5);
const ENVOY_START_TIMEOUT: Duration = Duration::from_secs(20);
const RLQS: &str = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas";
const EXAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/envoy/rlqs.yaml");

/// The limit the Envoy tests share: requests per second.
const LIMIT: u64 = 50;
const RULES: &str = "\
domain: rlqs
descriptors:
  - key: name
    value: api
    rate_limit: {unit: second, requests_per_unit: 50}
";

/// A real Envoy running the example bootstrap, on free ports, pointed at one turnstile.
struct Envoy {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl Envoy {
    async fn start(bin: &Path, turnstile: SocketAddr) -> Envoy {
        let dir = tempfile::tempdir().expect("temp dir");
        let (port, admin) = (free_port(), free_port());
        let config = std::fs::read_to_string(EXAMPLE)
            .expect("the example")
            .replace("port_value: 10000", &format!("port_value: {port}"))
            .replace("port_value: 9901", &format!("port_value: {admin}"))
            .replace(
                "port_value: 8081",
                &format!("port_value: {}", turnstile.port()),
            )
            .replace("address: 0.0.0.0", "address: 127.0.0.1");
        let path = dir.path().join("envoy.yaml");
        std::fs::write(&path, config).expect("write the bootstrap");
        let log = std::fs::File::create(dir.path().join("envoy.log")).expect("log file");
        let child = Command::new(bin)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                "warning",
                "-c",
            ])
            .arg(&path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn envoy");
        let mut envoy = Envoy { child, port, dir };
        let deadline = Instant::now() + ENVOY_START_TIMEOUT;
        while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
            if let Ok(Some(status)) = envoy.child.try_wait() {
                panic!("envoy exited at start-up ({status}): {}", envoy.log());
            }
            assert!(Instant::now() < deadline, "envoy not listening in time");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        envoy
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One keep-alive HTTP/1.1 connection.
struct Http {
    stream: BufReader<TcpStream>,
}

impl Http {
    async fn connect(port: u16) -> Http {
        let stream = TcpStream::connect(("127.0.0.1", port))
            .await
            .expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        Http {
            stream: BufReader::new(stream),
        }
    }

    /// GET /: the status, or None if the connection failed.
    async fn get(&mut self) -> Option<u16> {
        let request = b"GET / HTTP/1.1\r\nhost: test\r\n\r\n";
        self.stream.get_mut().write_all(request).await.ok()?;
        let mut line = String::new();
        self.stream.read_line(&mut line).await.ok()?;
        let status = line.split(' ').nth(1)?.parse().ok()?;
        let mut length = 0;
        loop {
            line.clear();
            if self.stream.read_line(&mut line).await.ok()? == 0 {
                return None;
            }
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().ok()?;
            }
        }
        let mut body = vec![0; length];
        self.stream.read_exact(&mut body).await.ok()?;
        Some(status)
    }
}

/// Requests sent through one Envoy: (when, since the test's start; admitted).
type Log = Vec<(Duration, bool)>;

/// Send `rate` requests per second to `port` over `connections` connections from `from` to
/// `until` (offsets from `t0`); a request that cannot keep up skips its tick rather than
/// bunching up.
fn load(
    port: u16,
    rate: u32,
    connections: u32,
    t0: Instant,
    from: Duration,
    until: Duration,
) -> tokio::task::JoinHandle<Log> {
    tokio::spawn(async move {
        tokio::time::sleep_until((t0 + from).into()).await;
        let mut senders = tokio::task::JoinSet::new();
        for _ in 0..connections {
            senders.spawn(async move {
                let mut http = Http::connect(port).await;
                let period = Duration::from_secs(1) / (rate / connections);
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                let mut log = Log::new();
                while t0.elapsed() < until {
                    tick.tick().await;
                    match http.get().await {
                        Some(status) => log.push((t0.elapsed(), status == 200)),
                        None => break,
                    }
                }
                log
            });
        }
        let mut all = Log::new();
        while let Some(log) = senders.join_next().await {
            all.extend(log.expect("a load task panicked"));
        }
        all
    })
}

/// Admitted requests of `log` in [from, until).
fn admitted(log: &Log, from: Duration, until: Duration) -> u64 {
    log.iter()
        .filter(|(at, ok)| *ok && *at >= from && *at < until)
        .count() as u64
}

fn sent(log: &Log, from: Duration, until: Duration) -> u64 {
    log.iter()
        .filter(|(at, _)| *at >= from && *at < until)
        .count() as u64
}

/// The first whole second (from `from`) after which `holds` is true of every second up to
/// `until`.
fn settled_at(
    from: Duration,
    until: Duration,
    holds: impl Fn(Duration) -> bool,
) -> Option<Duration> {
    let seconds: Vec<Duration> = (from.as_secs()..until.as_secs())
        .map(Duration::from_secs)
        .collect();
    (0..seconds.len())
        .find(|&i| seconds[i..].iter().all(|&s| holds(s)))
        .map(|i| seconds[i])
}

#[tokio::test]
async fn the_example_bootstrap_is_valid() {
    let Some(envoy) = support::tools::envoy_or_skip("the_example_bootstrap_is_valid") else {
        return;
    };
    let output = Command::new(envoy)
        .args(["--mode", "validate", "-c", EXAMPLE])
        .output()
        .expect("run envoy --mode validate");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Two Envoys, each on its own turnstile (sharing one Redis), one limit of 50/s. The light
/// Envoy (20/s) starts alone and takes the whole limit; the busy one (180/s) joins 2 s later:
/// within a few reports it holds most of the limit, and the fleet stays within the stated
/// bound throughout. Then the busy Envoy goes silent (SIGSTOP: its connection stays open,
/// no more reports): its share returns to the light one after the TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_envoys_share_the_limit_by_demand() {
    let Some(bin) = support::tools::envoy_or_skip("two_envoys_share_the_limit_by_demand") else {
        return;
    };
    let started = Instant::now();
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let ttl = Duration::from_secs(8);
    let args = [
        "--backend",
        "redis",
        "--redis-url",
        &redis.url(),
        "--rlqs-ttl",
        "8s",
    ];
    let first = Turnstile::start(rules.path(), &args).await;
    let second = Turnstile::start(rules.path(), &args).await;
    let busy = Envoy::start(&bin, first.grpc).await;
    let light = Envoy::start(&bin, second.grpc).await;

    let t0 = Instant::now();
    let secs = Duration::from_secs;
    let (busy_from, busy_until, light_until) = (secs(2), secs(27), secs(47));
    let light_log = load(light.port, 20, 1, t0, secs(0), light_until);
    let busy_log = load(busy.port, 180, 2, t0, busy_from, busy_until);
    let busy_log = busy_log.await.expect("busy load");
    support::turnstile::signal(busy.child.id(), "STOP");
    let killed = t0.elapsed();
    let light_log = light_log.await.expect("light load");

    // Rebalancing: from the second on which the busy Envoy admits at least 60% of the limit
    // in every second, until it stops.
    let per_second = |log: &Log, s: Duration| admitted(log, s, s + secs(1));
    let busy_settled = settled_at(busy_from, busy_until, |s| {
        per_second(&busy_log, s) * 10 >= LIMIT * 6
    })
    .expect("the busy Envoy never held most of the limit");
    let rebalancing = busy_settled - busy_from;

    // Accuracy over the whole time both ran: the stated bound is the limit's rate, plus one
    // burst (here one second's worth) for the buckets' starting tokens, plus one burst per
    // reporting interval for buckets rebuilt full by a changed share.
    let span = busy_until - busy_from;
    let total =
        admitted(&busy_log, busy_from, busy_until) + admitted(&light_log, busy_from, busy_until);
    let intervals = span.as_secs().div_ceil(REPORT_INTERVAL.as_secs());
    let bound = LIMIT * span.as_secs() + LIMIT * (1 + intervals);
    let worst_second = (busy_from.as_secs()..busy_until.as_secs())
        .map(|s| per_second(&busy_log, secs(s)) + per_second(&light_log, secs(s)))
        .max()
        .unwrap_or(0);

    let settled = busy_until - busy_settled;
    let settled_total = admitted(&busy_log, busy_settled, busy_until)
        + admitted(&light_log, busy_settled, busy_until);

    // The silent Envoy's share returns to the light one after the TTL (and its next report):
    // from then on it admits (nearly) all of its 20/s.
    let light_settled = settled_at(killed, light_until, |s| per_second(&light_log, s) >= 18);
    eprintln!(
        "rlqs: busy sent {} admitted {}, light sent {} admitted {} in {span:?}; fleet admitted \
         {total} (limit x span {}, bound {bound}, overshoot {:+.1}%); worst second {worst_second}; \
         busy held most of the limit {rebalancing:?} after it started; from then on the fleet \
         admitted {settled_total} in {settled:?} ({:+.1}% of the limit); light got the silent \
         Envoy's share {:?} after it stopped; test ran {:?}",
        sent(&busy_log, busy_from, busy_until),
        admitted(&busy_log, busy_from, busy_until),
        sent(&light_log, busy_from, busy_until),
        admitted(&light_log, busy_from, busy_until),
        LIMIT * span.as_secs(),
        (total as f64 / (LIMIT * span.as_secs()) as f64 - 1.0) * 100.0,
        (settled_total as f64 / (LIMIT * settled.as_secs()) as f64 - 1.0) * 100.0,
        light_settled.map(|s| s - killed),
        started.elapsed(),
    );
    assert!(
        sent(&busy_log, busy_from, busy_until) > 2 * LIMIT * span.as_secs(),
        "the busy Envoy did not send enough to test anything"
    );
    assert!(
        total <= bound,
        "fleet admitted {total}, over the bound {bound}"
    );
    // Once settled, the limit is used, not wasted.
    assert!(
        settled_total * 10 >= LIMIT * settled.as_secs() * 8,
        "fleet admitted {settled_total} in {settled:?} once settled: far under the limit"
    );
    assert!(
        rebalancing <= 4 * REPORT_INTERVAL,
        "the busy Envoy took {rebalancing:?} to hold most of the limit"
    );
    let light_settled = light_settled.expect("the light Envoy never got the silent one's share");
    assert!(
        light_settled - killed <= ttl + 2 * REPORT_INTERVAL,
        "the silent Envoy's share came back after {:?}",
        light_settled - killed
    );
    // A share is only ever a token bucket: the busy Envoy was limited, not let through.
    assert!(
        first
            .metric("turnstile_rlqs_assignments{action=\"token_bucket\"}")
            .await
            >= Some(4.0)
    );
}

/// A plain RLQS stream to one turnstile.
struct Stream {
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    answers: Streaming<RateLimitQuotaResponse>,
}

impl Stream {
    async fn open(turnstile: &Turnstile) -> Stream {
        Stream::try_open(turnstile)
            .await
            .expect("open the RLQS stream")
    }

    async fn try_open(turnstile: &Turnstile) -> Result<Stream, tonic::Status> {
        let (reports, rx) = mpsc::channel(4);
        let outbound = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|report| (report, rx))
        });
        let answers = RateLimitQuotaServiceClient::new(turnstile.channel().await)
            .stream_rate_limit_quotas(outbound)
            .await?
            .into_inner();
        Ok(Stream { reports, answers })
    }

    /// Report until the answer is a share (the backend may still be connecting); the share.
    async fn share(&mut self, requests: u64) -> String {
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let answer = describe(self.report(requests).await);
            if answer.starts_with("tokens") || Instant::now() > deadline {
                return answer;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Close the stream as Envoy does (end of reports), and wait for turnstile to end it.
    async fn close(mut self) {
        drop(self.reports);
        let end = tokio::time::timeout(Duration::from_secs(2), self.answers.message()).await;
        assert!(
            matches!(end, Ok(Ok(None))),
            "the stream did not end: {end:?}"
        );
    }

    /// Report `requests` on the bucket {name: api} and return the action answered, if one
    /// comes within a second.
    async fn report(&mut self, requests: u64) -> Option<Action> {
        self.report_to("rlqs", ("name", "api"), requests)
            .await
            .expect("RLQS stream failed")
    }

    /// Report one request on each of `n` buckets {user: `tag`-i-(1 000 bytes)} of the domain
    /// `rlqs` in one report; how many buckets got each action.
    async fn report_many(&mut self, tag: &str, n: usize) -> BTreeMap<String, usize> {
        self.try_report_many(tag, n)
            .await
            .expect("RLQS stream failed")
    }

    /// As `report_many`, or the stream's error.
    async fn try_report_many(
        &mut self,
        tag: &str,
        n: usize,
    ) -> Result<BTreeMap<String, usize>, tonic::Status> {
        let padding = "x".repeat(1_000);
        let buckets = (0..n)
            .map(|i| BucketQuotaUsage {
                bucket_id: Some(BucketId {
                    bucket: [("user".to_owned(), format!("{tag}-{i}-{padding}"))].into(),
                }),
                time_elapsed: None,
                num_requests_allowed: 1,
                num_requests_denied: 0,
            })
            .collect();
        let report = RateLimitQuotaUsageReports {
            domain: "rlqs".into(),
            bucket_quota_usages: buckets,
        };
        self.reports.send(report).await.expect("send a report");
        let answer = tokio::time::timeout(Duration::from_secs(5), self.answers.message())
            .await
            .expect("an answer in time")?
            .expect("an answer");
        let mut answers = BTreeMap::new();
        for action in answer.bucket_action {
            *answers.entry(describe(action.bucket_action)).or_default() += 1;
        }
        Ok(answers)
    }

    /// Report `requests` on the bucket {key: value} of `domain`; the action answered, if one
    /// comes within a second, or the stream's error.
    async fn report_to(
        &mut self,
        domain: &str,
        (key, value): (&str, &str),
        requests: u64,
    ) -> Result<Option<Action>, tonic::Status> {
        let id = BucketId {
            bucket: [(key.to_owned(), value.to_owned())].into(),
        };
        let bucket = BucketQuotaUsage {
            bucket_id: Some(id.clone()),
            time_elapsed: None,
            num_requests_allowed: requests,
            num_requests_denied: 0,
        };
        let report = RateLimitQuotaUsageReports {
            domain: domain.into(),
            bucket_quota_usages: vec![bucket],
        };
        self.reports.send(report).await.expect("send a report");
        let answer = tokio::time::timeout(Duration::from_secs(1), self.answers.message()).await;
        let Ok(answer) = answer else {
            return Ok(None);
        };
        let Some(mut answer) = answer? else {
            return Ok(None);
        };
        assert_eq!(answer.bucket_action.len(), 1);
        let action = answer.bucket_action.remove(0);
        assert_eq!(action.bucket_id, Some(id), "the bucket id is echoed");
        Ok(action.bucket_action)
    }
}

/// What an action tells Envoy, in short: "tokens N", "allow_all", "deny_all" or "abandon".
fn describe(action: Option<Action>) -> String {
    match action {
        None => "none".into(),
        Some(Action::AbandonAction(_)) => "abandon".into(),
        Some(Action::QuotaAssignmentAction(assignment)) => {
            match assignment.rate_limit_strategy.and_then(|s| s.strategy) {
                Some(Strategy::TokenBucket(bucket)) => {
                    format!("tokens {}", bucket.tokens_per_fill.map_or(0, |t| t.value))
                }
                Some(Strategy::BlanketRule(rule)) if rule == BlanketRule::DenyAll as i32 => {
                    "deny_all".into()
                }
                Some(Strategy::BlanketRule(_)) => "allow_all".into(),
                other => format!("{other:?}"),
            }
        }
    }
}

const CLIENT_RULES: &str = "\
domain: rlqs
descriptors:
  - key: name
    value: api
    rate_limit: {unit: second, requests_per_unit: 100}
";

/// Redis stops answering: each failure policy's answer to the next report; once Redis is
/// back, the same stream gets a share again.
#[tokio::test]
async fn a_lost_redis_is_answered_by_the_failure_policy() {
    let rules = Rules::new(CLIENT_RULES);
    let cases = [
        ("allow", "allow_all"),
        ("deny", "deny_all"),
        // Envoy keeps its assignment until the TTL, then its expired_assignment_behavior.
        ("error", "none"),
        // This instance splits the limit among its own streams.
        ("local", "tokens 100"),
    ];
    for (policy, expected) in cases {
        let mut redis = RedisServer::start();
        let turnstile = Turnstile::start(
            rules.path(),
            &[
                "--backend",
                "redis",
                "--redis-url",
                &redis.url(),
                "--on-backend-error",
                policy,
            ],
        )
        .await;
        let mut stream = Stream::open(&turnstile).await;
        assert_eq!(stream.share(10).await, "tokens 100", "{policy}");
        const UNANSWERED: &str = "turnstile_rlqs_assignments{action=\"none\"}";
        let unanswered = turnstile.metric(UNANSWERED).await.unwrap_or(0.0);
        redis.stop();
        assert_eq!(describe(stream.report(10).await), expected, "{policy}");
        if expected == "none" {
            // No answer is also what a hung stream gives: the report must have been decided,
            // to send nothing.
            let deadline = Instant::now() + Duration::from_secs(5);
            while turnstile.metric(UNANSWERED).await.unwrap_or(0.0) <= unanswered {
                assert!(
                    Instant::now() < deadline,
                    "{policy}: the report was never decided"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // Unanswered or not, the stream still reads its reports: Redis back, a share again.
        redis.restart();
        assert_eq!(stream.share(10).await, "tokens 100", "{policy}, Redis back");
    }
}

/// Shares are reserved in Redis: a restarted turnstile still counts the share its dead stream
/// handed out (the Envoy enforces it until the TTL), so a new stream gets only what is free;
/// the memory backend forgets it. A stream Envoy closes frees its share at once.
#[tokio::test]
async fn reservations_outlive_a_restart_until_the_ttl() {
    let rules = Rules::new(CLIENT_RULES);
    let redis = RedisServer::start();
    let redis_url = redis.url();
    let cases: [(&[&str], &str); 2] = [
        (
            &["--backend", "redis", "--redis-url", &redis_url],
            "tokens 0",
        ),
        (&["--backend", "memory"], "tokens 100"),
    ];
    for (backend, after_restart) in cases {
        let mut args = backend.to_vec();
        args.extend(["--rlqs-ttl", "2s"]);
        let mut turnstile = Turnstile::start(rules.path(), &args).await;
        let mut first = Stream::open(&turnstile).await;
        assert_eq!(first.share(10).await, "tokens 100", "{backend:?}");
        turnstile.kill_and_restart().await;
        let mut second = Stream::open(&turnstile).await;
        assert_eq!(second.share(90).await, after_restart, "{backend:?}");
        // The dead stream's reservation lapses at the TTL: reports until the whole limit is
        // free (at most 10 s).
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let share = describe(second.report(90).await);
            if share == "tokens 100" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{backend:?}: still {share} after the TTL"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Closed by the client: freed at once for the next stream.
        second.close().await;
        let mut third = Stream::open(&turnstile).await;
        let answer = third.share(10).await;
        assert_eq!(answer, "tokens 100", "{backend:?}");
    }
}

/// The Redis script is the twin of the in-process arithmetic: the same reports get the same
/// shares from both. Reports of 0 requests make the demand exact whatever the timing.
#[tokio::test]
async fn memory_and_redis_assign_the_same_shares() {
    let rules = Rules::new(CLIENT_RULES);
    let redis = RedisServer::start();
    let redis_url = redis.url();
    // (stream, requests reported, share answered), for a limit of 100/s. A first report
    // counts over 5 s: 50 requests are 10/s, 450 are 90/s.
    let steps = [
        (0, 50, "tokens 100"), // alone: everything
        (1, 450, "tokens 0"),  // nothing is free
        (0, 0, "tokens 5"),    // idle: shrinks to its idle weight's part
        (1, 0, "tokens 50"),   // both idle: half, and half is free
        (0, 0, "tokens 50"),   // grows into what the other left
        (0, 0, "tokens 50"),   // unchanged
    ];
    let backends: [&[&str]; 2] = [
        &["--backend", "memory"],
        &["--backend", "redis", "--redis-url", &redis_url],
    ];
    for backend in backends {
        let turnstile = Turnstile::start(rules.path(), backend).await;
        let mut streams = [
            Stream::open(&turnstile).await,
            Stream::open(&turnstile).await,
        ];
        for (i, &(stream, requests, share)) in steps.iter().enumerate() {
            let answer = streams[stream].share(requests).await;
            assert_eq!(answer, share, "{backend:?} step {i}");
        }
    }
}

/// What is not a limited bucket: a stream without a domain is refused; a bucket of an
/// unknown domain, one no rule covers, or one of an unlimited rule is allowed (not abandoned:
/// Envoy 1.40 would re-create and report it at its next request).
#[tokio::test]
async fn buckets_without_a_limit_are_allowed() {
    let rules = Rules::new(&format!(
        "{CLIENT_RULES}  - key: name\n    value: free\n    rate_limit: {{unlimited: true}}\n"
    ));
    let turnstile = Turnstile::start(rules.path(), &[]).await;
    let cases = [
        ("", ("name", "api"), "refused: InvalidArgument"),
        ("nope", ("name", "api"), "allow_all"),
        ("rlqs", ("name", "other"), "allow_all"),
        ("rlqs", ("user", "api"), "allow_all"),
        ("rlqs", ("name", "free"), "allow_all"),
        ("rlqs", ("name", "api"), "tokens 100"),
    ];
    for (domain, bucket, expected) in cases {
        let mut stream = Stream::open(&turnstile).await;
        let answer = match stream.report_to(domain, bucket, 1).await {
            Ok(action) => describe(action),
            Err(status) => format!("refused: {:?}", status.code()),
        };
        assert_eq!(answer, expected, "{domain} {bucket:?}");
    }
    assert!(
        turnstile
            .metric("ratelimit_service_rate_limit_nope_domain_not_found")
            .await
            >= Some(1.0)
    );
}

/// Limited buckets with ids of about 1 KB, as `Stream::report_many` reports them.
const USERS: &str = "domain: rlqs\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 100}\n";

/// A stream tracks a bounded amount of buckets: past its budget (4 MiB), new limited buckets
/// are denied rather than tracked, and the ones it holds keep their shares.
#[tokio::test]
async fn a_stream_tracks_a_bounded_number_of_buckets() {
    let rules = Rules::new(USERS);
    let turnstile = Turnstile::start(rules.path(), &[]).await;
    let mut stream = Stream::open(&turnstile).await;
    let mut answers = BTreeMap::<String, usize>::new();
    for batch in 0..3 {
        for (action, n) in stream.report_many(&batch.to_string(), 700).await {
            *answers.entry(action).or_default() += n;
        }
    }
    let (shares, denied) = (answers["tokens 100"], answers["deny_all"]);
    assert_eq!((shares + denied, answers.len()), (2_100, 2), "{answers:?}");
    // About 2.2 KB a bucket here: 4 MiB holds about 1 900.
    assert!((1_700..2_000).contains(&shares), "{answers:?}");
}

/// All streams together track a bounded amount of buckets too (`--rlqs-max-bytes`, 3 MiB
/// here, about 1 400 buckets): a second stream gets shares only for what the first left, the
/// rest DENY_ALL; once Envoy ends the first, its part is free again for a third.
#[tokio::test]
async fn streams_together_track_a_bounded_number_of_buckets() {
    let rules = Rules::new(USERS);
    let turnstile = Turnstile::start(rules.path(), &["--rlqs-max-bytes", "3145728"]).await;
    let mut first = Stream::open(&turnstile).await;
    let mut second = Stream::open(&turnstile).await;
    assert_eq!(
        first.report_many("first", 900).await,
        [("tokens 100".into(), 900)].into()
    );
    let answers = second.report_many("second", 900).await;
    let shares = answers["tokens 100"];
    assert!((300..700).contains(&shares), "{answers:?}");
    assert_eq!(answers["deny_all"], 900 - shares, "{answers:?}");
    first.close().await;
    let mut third = Stream::open(&turnstile).await;
    assert_eq!(
        third.report_many("third", 400).await,
        [("tokens 100".into(), 400)].into()
    );
}

/// What all streams' reports and answers hold together is bounded too
/// (`--rlqs-max-buffer-bytes`, 2.5 MB here). A report of 900 buckets of about 1 KB and its
/// answer hold about 1.9 MB: a second stream's report of that size is refused
/// RESOURCE_EXHAUSTED, while the first stream, its sizes not growing, is still answered; once
/// Envoy ends the first, a third is answered.
#[tokio::test]
async fn streams_together_buffer_a_bounded_number_of_bytes() {
    let rules = Rules::new(USERS);
    let turnstile = Turnstile::start(rules.path(), &["--rlqs-max-buffer-bytes", "2500000"]).await;
    let all = |n| BTreeMap::from([("tokens 100".to_owned(), n)]);
    let mut first = Stream::open(&turnstile).await;
    let mut second = Stream::open(&turnstile).await;
    assert_eq!(first.report_many("first", 900).await, all(900));
    let refused = second.try_report_many("second", 900).await.err();
    assert_eq!(
        refused.as_ref().map(tonic::Status::code),
        Some(tonic::Code::ResourceExhausted),
        "{refused:?}"
    );
    assert!(
        refused
            .unwrap()
            .message()
            .contains("(--rlqs-max-buffer-bytes)"),
        "the refusal names its bound"
    );
    assert_eq!(first.report_many("first", 900).await, all(900));
    first.close().await;
    let mut third = Stream::open(&turnstile).await;
    assert_eq!(third.report_many("third", 900).await, all(900));
}

/// A report is charged once its prefix declares its length, before its bytes come (tonic sets
/// that much aside then): a stream that only declares a report past the budget (500 000 bytes
/// here) is refused at once, RESOURCE_EXHAUSTED; one past `--max-message-bytes` (1 MiB) is
/// refused by tonic, OUT_OF_RANGE.
#[tokio::test]
async fn a_report_is_charged_from_its_prefix() {
    let rules = Rules::new(USERS);
    let turnstile = Turnstile::start(rules.path(), &["--rlqs-max-buffer-bytes", "500000"]).await;
    let rows = [
        (
            1_000_000,
            tonic::Code::ResourceExhausted,
            "(--rlqs-max-buffer-bytes)",
        ),
        (2 << 20, tonic::Code::OutOfRange, "the limit is"),
    ];
    for (declared, code, says) in rows {
        let (send, driver) = raw_connection(&turnstile).await;
        let body = RawBody {
            data: Some(framed(0, declared, b"")),
            stall: true,
            ..Default::default()
        };
        let status = raw_call(send, RLQS, "10S", body).await;
        driver.abort();
        assert_eq!(status.code(), code, "{declared}: {status:?}");
        assert!(status.message().contains(says), "{declared}: {status:?}");
    }
}

/// Streams open at once are bounded, in all (`--rlqs-max-streams`) and per peer address
/// (`--rlqs-max-streams-per-peer`; every stream here comes from 127.0.0.1), 2 in each row: one
/// more is refused RESOURCE_EXHAUSTED while the open ones keep being answered, and once Envoy
/// ends one, a new stream takes its place.
#[tokio::test]
async fn open_streams_are_bounded() {
    let rules = Rules::new(USERS);
    for flag in ["--rlqs-max-streams", "--rlqs-max-streams-per-peer"] {
        let turnstile = Turnstile::start(rules.path(), &[flag, "2"]).await;
        let mut first = Stream::open(&turnstile).await;
        let mut second = Stream::open(&turnstile).await;
        let refused = Stream::try_open(&turnstile).await.err();
        assert_eq!(
            refused.as_ref().map(tonic::Status::code),
            Some(tonic::Code::ResourceExhausted),
            "{flag}: {refused:?}"
        );
        assert!(
            refused.unwrap().message().contains(&format!("({flag})")),
            "{flag}"
        );
        for (tag, stream) in [("first", &mut first), ("second", &mut second)] {
            assert_eq!(
                stream.report_many(tag, 1).await,
                [("tokens 100".into(), 1)].into(),
                "{flag}"
            );
        }
        first.close().await;
        let mut third = Stream::open(&turnstile).await;
        assert_eq!(
            third.report_many("third", 1).await,
            [("tokens 100".into(), 1)].into(),
            "{flag}"
        );
    }
}
