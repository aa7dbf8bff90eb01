//! `turnstile-bench`: a gRPC load generator for any `RateLimitService` (turnstile or the
//! reference), so throughput and latency are measured the way Envoy calls the service. A
//! crate of its own so the service binary carries no load-testing code; turnstile's tests
//! drive their loads with its [`worker`], [`channel`] and request builders.
//!
//! Closed loop (the default): `--concurrency` calls are kept in flight, a call sent each time
//! one answers; this finds the peak rate. Open loop (`--rate`): calls are due at a fixed
//! arrival rate and each latency is measured from the time the call was *due*, not from when
//! it was sent, so a server that falls behind shows its queueing in the percentiles instead
//! of slowing the generator down (no coordinated omission); the calls due are released
//! together every [`TICK`]. Each loop is one task, whose sends go out together. Every run is
//! bounded in time (`--duration`, plus at most one `--timeout` to drain) and optionally in
//! count (`--requests`).

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, ValueEnum};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use futures_util::FutureExt as _;
use hdrhistogram::Histogram;
use tokio::time::Instant;
use tonic::codegen::{Body, Bytes, StdError};
use tonic::transport::{Channel, Endpoint};

mod grpc;

/// The message of the DEADLINE_EXCEEDED a call gets when it passes the client-side bound.
pub const CLIENT_TIMEOUT: &str = "client timeout";

fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| e.to_string())
}

/// The longest run accepted, so a typo cannot start an endless load.
const MAX_DURATION: Duration = Duration::from_secs(3_600);
/// Latencies above this are recorded as this (the histogram's range).
const MAX_LATENCY_NS: u64 = 60_000_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KeyOrder {
    /// Each descriptor value drawn uniformly from the `--keys` values.
    Uniform,
    /// Values in turn (0, 1, 2, … modulo `--keys`): touches every key in `--keys` calls.
    Sequential,
}

/// Load a RateLimitService over gRPC and report throughput and latency.
#[derive(Parser)]
#[command(name = "turnstile-bench", version)]
pub struct Cli {
    #[command(flatten)]
    pub args: BenchArgs,
}

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// gRPC address(es) of the service, comma-separated or repeated; calls go round-robin.
    #[arg(
        long = "target",
        value_delimiter = ',',
        default_value = "127.0.0.1:8081"
    )]
    pub targets: Vec<String>,
    /// Calls in flight at once (closed loop), or most calls in flight (open loop).
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// HTTP/2 connections per target; calls are spread over them.
    #[arg(long, default_value_t = 2)]
    pub connections: usize,
    /// Key cardinality: descriptor values are drawn from this many distinct values.
    #[arg(long, default_value_t = 1)]
    pub keys: u64,
    /// How values are drawn.
    #[arg(long, value_enum, default_value = "uniform")]
    pub key_order: KeyOrder,
    /// Descriptors per request.
    #[arg(long, default_value_t = 1)]
    pub descriptors: usize,
    /// The request's domain.
    #[arg(long, default_value = "bench")]
    pub domain: String,
    /// Descriptor entry key(s), comma-separated: descriptor i uses key i modulo their number.
    #[arg(long = "key", value_delimiter = ',', default_value = "user")]
    pub descriptor_keys: Vec<String>,
    /// Prefix of every descriptor value (values are `<prefix><n>`).
    #[arg(long, default_value = "u")]
    pub value_prefix: String,
    /// How long to measure (at most 1 h).
    #[arg(long, value_parser = duration, default_value = "10s")]
    pub duration: Duration,
    /// Load sent before measuring, not counted.
    #[arg(long, value_parser = duration, default_value = "1s")]
    pub warmup: Duration,
    /// Stop after this many measured calls (0: no cap).
    #[arg(long, default_value_t = 0)]
    pub requests: u64,
    /// Open loop: calls per second at fixed intervals, latency counted from each call's due
    /// time. Without it the loop is closed.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Bound on one call; a call past it counts as an error.
    #[arg(long, value_parser = duration, default_value = "1s")]
    pub timeout: Duration,
    /// Runtime threads of the generator (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Also report the CPU time of these processes per measured call, as NAME=PID
    /// (comma-separated or repeated; Linux /proc). The generator's own is always reported.
    #[arg(long = "watch-pid", value_delimiter = ',', value_parser = watched)]
    pub watch: Vec<(String, u32)>,
    /// Print the result as one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn watched(text: &str) -> Result<(String, u32), String> {
    let (name, pid) = text
        .split_once('=')
        .ok_or_else(|| format!("expected NAME=PID, got {text:?}"))?;
    let pid = pid.parse().map_err(|e| format!("PID {pid:?}: {e}"))?;
    Ok((name.to_owned(), pid))
}

/// User + system CPU seconds a process has used so far (all its threads), from
/// `/proc/<pid>/stat`; None where that cannot be read.
fn cpu_seconds(pid: Option<u32>) -> Option<f64> {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/stat"),
        None => "/proc/self/stat".to_owned(),
    };
    let stat = std::fs::read_to_string(path).ok()?;
    // The command name, in parentheses, may hold spaces: count fields after it. utime and
    // stime are fields 14 and 15 of the line, in clock ticks (100 per second on Linux).
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// CPU seconds of the generator ("bench") and of every watched process, now.
fn cpu_snapshot(watch: &[(String, u32)]) -> Vec<(String, Option<f64>)> {
    std::iter::once(("bench".to_owned(), cpu_seconds(None)))
        .chain(
            watch
                .iter()
                .map(|(name, pid)| (name.clone(), cpu_seconds(Some(*pid)))),
        )
        .collect()
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1_000, MAX_LATENCY_NS, 3).expect("static histogram bounds")
}

fn nanos(d: Duration) -> u64 {
    d.as_nanos().min(u128::from(MAX_LATENCY_NS)) as u64
}

/// What a load saw.
struct Tally {
    /// From each call's due time (its send time in a closed loop) to its answer.
    latency: Histogram<u64>,
    /// From each call's actual send to its answer: differs from `latency` only in an open
    /// loop, where the gap is the wait for the next tick, or for a place among those in flight.
    service: Histogram<u64>,
    /// Open loop: from due to sent, of the calls that found a place free when released. What
    /// the generator's own pace adds (its tick, and the CPU it waited for), apart from the
    /// service's.
    send_lag: Histogram<u64>,
    /// Open loop: calls released on time that found every place taken, so were sent late
    /// because earlier calls had not been answered (a stall of the service, or of the path
    /// to it, or the catching up after one).
    waited_for_place: u64,
    /// Open loop: calls the generator released late (`LATE_RELEASE`): it was itself off the
    /// CPU, or behind.
    released_late: u64,
    ok: u64,
    over_limit: u64,
    other: u64,
    errors: BTreeMap<String, u64>,
}

impl Tally {
    fn new() -> Tally {
        Tally {
            latency: histogram(),
            service: histogram(),
            send_lag: histogram(),
            waited_for_place: 0,
            released_late: 0,
            ok: 0,
            over_limit: 0,
            other: 0,
            errors: BTreeMap::new(),
        }
    }

    /// A call's answer and times, unless it was due before `measure_from` (the warm-up).
    fn record(&mut self, call: &Call, measure_from: std::time::Instant) {
        if call.due < measure_from {
            return;
        }
        match &call.answer {
            Ok(response) => {
                self.latency
                    .saturating_record(nanos(call.answered - call.due));
                self.service
                    .saturating_record(nanos(call.answered - call.sent));
                match Code::try_from(response.overall_code) {
                    Ok(Code::Ok) => self.ok += 1,
                    Ok(Code::OverLimit) => self.over_limit += 1,
                    _ => self.other += 1,
                }
            }
            Err(status) => {
                let kind = if status.message() == CLIENT_TIMEOUT {
                    "Timeout".to_owned()
                } else {
                    format!("{:?}", status.code())
                };
                *self.errors.entry(kind).or_default() += 1;
            }
        }
    }

    /// An open loop's call, and how it left.
    fn record_open(&mut self, call: &Call, left: Departure, measure_from: std::time::Instant) {
        if call.due < measure_from {
            return;
        }
        if left.released_late {
            self.released_late += 1;
        } else if left.waited {
            self.waited_for_place += 1;
        }
        if !left.waited {
            self.send_lag.saturating_record(nanos(call.sent - call.due));
        }
        self.record(call, measure_from);
    }

    fn calls(&self) -> u64 {
        self.ok + self.over_limit + self.other + self.errors.values().sum::<u64>()
    }
}

/// Builds the requests: values drawn from `keys`, uniformly or in turn.
struct Requests {
    domain: String,
    keys: Vec<String>,
    prefix: String,
    descriptors: usize,
    cardinality: u64,
    order: KeyOrder,
    sequence: AtomicU64,
}

impl Requests {
    fn value(&self, rng: &mut fastrand::Rng) -> u64 {
        match self.order {
            KeyOrder::Uniform => rng.u64(0..self.cardinality),
            KeyOrder::Sequential => {
                self.sequence.fetch_add(1, Ordering::Relaxed) % self.cardinality
            }
        }
    }

    fn build(&self, rng: &mut fastrand::Rng) -> RateLimitRequest {
        let descriptors = (0..self.descriptors)
            .map(|i| {
                let mut value = String::with_capacity(self.prefix.len() + 8);
                value.push_str(&self.prefix);
                let _ = write!(value, "{}", self.value(rng));
                descriptor(&[(&self.keys[i % self.keys.len()], &value)])
            })
            .collect();
        request(&self.domain, descriptors)
    }
}

/// A descriptor of these `(key, value)` entries.
pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| Entry {
                key: (*key).into(),
                value: (*value).into(),
            })
            .collect(),
        ..Default::default()
    }
}

/// A request for `domain` (hits_addend 0: one hit each).
pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

/// When each call of an open loop is due: call `i` at `i / rate` seconds after `start`. The
/// pacer's releases and each call's latency both read [`Timetable::due`], so that a call is
/// released by the same reckoning it is timed by: computed two ways (an interval rounded to
/// the nanosecond, against `elapsed × rate`), the two drift apart a fraction of a nanosecond
/// a call.
#[derive(Debug, Clone, Copy)]
struct Timetable {
    start: std::time::Instant,
    rate: f64,
    /// Calls in the whole run.
    total: u64,
}

impl Timetable {
    /// `seconds` at `rate`, the warm-up's calls included; with a `cap` (`--requests`), at
    /// most that many after the warm-up's.
    fn new(start: Instant, rate: f64, seconds: f64, cap: u64, warmup_calls: u64) -> Timetable {
        let mut total = (seconds * rate).ceil() as u64;
        if cap > 0 {
            total = total.min(warmup_calls + cap);
        }
        Timetable {
            start: start.into_std(),
            rate,
            total,
        }
    }

    fn due(&self, i: u64) -> std::time::Instant {
        self.start + Duration::from_secs_f64(i as f64 / self.rate)
    }

    /// How many calls are due at `now`, given that `done` were: every call up to the first
    /// not yet due (or all of them).
    fn due_at(&self, mut done: u64, now: std::time::Instant) -> u64 {
        while done < self.total && self.due(done) <= now {
            done += 1;
        }
        done
    }
}

/// What a loop sends, and on what: its requests, in turn over the connections, each call
/// bounded by `timeout`.
struct Sending {
    requests: Requests,
    rng: fastrand::Rng,
    clients: Vec<grpc::Connection>,
    timeout: Duration,
    /// Calls made so far.
    made: u64,
}

impl Sending {
    /// The next call, due at `due`: it is sent when first polled.
    fn call(&mut self, due: std::time::Instant) -> impl Future<Output = Call> + use<> {
        let mut client = self.clients[self.made as usize % self.clients.len()].clone();
        self.made += 1;
        let request = self.requests.build(&mut self.rng);
        let timeout = self.timeout;
        async move { timed_call(&mut client, due, request, timeout).await }
    }
}

/// A closed loop: one task keeps `concurrency` calls in flight, sending a call each time one
/// answers, until `until` (or, with a `cap`, until that many calls were sent after
/// `measure_from`). All of it in one task, so the calls that answers arriving together free
/// are all queued on their connections before any connection writes, as an event loop
/// such as Envoy's writes once per pass: with a task per call in flight, the runtime ran a
/// connection's task after each send (its LIFO slot), and the generator wrote about 0.7
/// times per call.
struct ClosedLoop {
    concurrency: usize,
    until: std::time::Instant,
    cap: u64,
}

impl ClosedLoop {
    async fn run(self, mut sending: Sending, measure_from: std::time::Instant) -> Tally {
        let ClosedLoop {
            concurrency,
            until,
            cap,
        } = self;
        let mut tally = Tally::new();
        let mut in_flight = futures_util::stream::FuturesUnordered::new();
        // Calls sent once measuring had begun (for the cap).
        let mut measured = 0u64;
        loop {
            while in_flight.len() < concurrency {
                let now = std::time::Instant::now();
                if now >= until || (cap > 0 && measured >= cap) {
                    break;
                }
                measured += u64::from(now >= measure_from);
                in_flight.push(sending.call(now));
            }
            match futures_util::StreamExt::next(&mut in_flight).await {
                Some(call) => tally.record(&call, measure_from),
                None => return tally,
            }
        }
    }
}

/// How often an open loop's pacer wakes: the calls that fall due between two ticks leave
/// together at the second, in one write per connection, each at most this late (and
/// counted late, since latency runs from its due time). Woken for each call by a timer
/// armed for it, the generator spent more of the cores it shares with the service than the
/// service did (about 25 µs a call at 40 000/s, where a closed loop spends 6; on a VM,
/// setting a timer alone cost about 6 µs), and its own delays set the p99 it reported. A
/// tenth of a millisecond is a twentieth of the tightest latency target it measures (2 ms).
const TICK: Duration = Duration::from_micros(100);

/// A call released this long after it was due was late by the generator's own doing: its
/// pacer, which wakes every tick, was off the CPU or behind with its own work.
const LATE_RELEASE: Duration = Duration::from_micros(500);

/// How an open loop's call left: whether the generator released it late, and whether it
/// then found every place taken.
#[derive(Clone, Copy)]
struct Departure {
    released_late: bool,
    waited: bool,
}

/// An open loop: one task sends every call of the timetable once it is due, at most
/// `concurrency` in flight (a due call waits for an answer to free a place, and its wait
/// counts), and records the answers. Calls not sent within `grace` of the last due time
/// are counted unsent. All of it in one task, so the calls due at a tick are all queued on
/// their connections before any connection writes.
struct OpenLoop {
    timetable: Timetable,
    concurrency: usize,
    grace: Duration,
}

impl OpenLoop {
    /// The calls' tally and how many went unsent.
    async fn run(
        self,
        mut sending: Sending,
        measure_from: std::time::Instant,
    ) -> std::io::Result<(Tally, u64)> {
        let OpenLoop {
            timetable,
            concurrency,
            grace,
        } = self;
        let mut ticker = Some(Ticker::every(TICK)?);
        let mut tally = Tally::new();
        let mut in_flight = futures_util::stream::FuturesUnordered::new();
        let last_send = timetable.due(timetable.total) + grace;
        // Calls due at the last tick, and calls that will be sent (all of them, unless
        // some miss the grace); `sending.made` counts those sent.
        let (mut released, mut to_send) = (0u64, timetable.total);
        // Calls before this one were released while every place was taken.
        let mut waits_before = 0u64;
        // The calls released late and not yet sent, in order, as ranges of their numbers.
        let mut late: VecDeque<Range<u64>> = VecDeque::new();
        loop {
            loop {
                while sending.made < released && in_flight.len() < concurrency {
                    let number = sending.made;
                    while late.front().is_some_and(|r| r.end <= number) {
                        late.pop_front();
                    }
                    let left = Departure {
                        released_late: late.front().is_some_and(|r| r.contains(&number)),
                        waited: number < waits_before,
                    };
                    let call = sending.call(timetable.due(number));
                    in_flight.push(call.map(move |call| (call, left)));
                }
                if sending.made == released {
                    break;
                }
                // Every place is taken. Answers already in free theirs first (after this
                // task was itself kept off the CPU they all are), so that only calls which
                // found no answer in count as waiting for a place.
                match futures_util::StreamExt::next(&mut in_flight).now_or_never() {
                    Some(Some((call, left))) => tally.record_open(&call, left, measure_from),
                    _ => {
                        waits_before = released;
                        break;
                    }
                }
            }
            let sent = sending.made;
            if sent == to_send {
                // Nothing left to pace: the timer stops.
                ticker = None;
                if in_flight.is_empty() {
                    return Ok((tally, timetable.total - sent));
                }
            }
            tokio::select! {
                Some((call, left)) = futures_util::StreamExt::next(&mut in_flight) => {
                    tally.record_open(&call, left, measure_from);
                }
                ticked = async {
                    match &ticker {
                        Some(ticker) => ticker.tick().await,
                        None => std::future::pending().await,
                    }
                }, if ticker.is_some() => {
                    ticked?;
                    let now = std::time::Instant::now();
                    if now > last_send {
                        to_send = sent;
                    }
                    let before = released;
                    released = timetable.due_at(released, now).min(to_send);
                    if let Some(late_if_due_before) = now.checked_sub(LATE_RELEASE) {
                        let late_end = timetable.due_at(before, late_if_due_before).min(released);
                        // A pacer behind tick after tick extends one range.
                        match late.back_mut() {
                            _ if late_end <= before => {}
                            Some(range) if range.end == before => range.end = late_end,
                            _ => late.push_back(before..late_end),
                        }
                    }
                    // At rates below a call a tick, the ticks start again at the next due
                    // time: that call leaves on time, and no tick finds nothing due.
                    let next = timetable.due(released);
                    if let Some(ticker) = &ticker
                        && released < to_send
                        && next > now + 2 * TICK
                    {
                        ticker.first_in(next - now)?;
                    }
                }
            }
        }
    }
}

/// A periodic timer precise to the microsecond that the generator's runtime waits on like a
/// socket: a Linux timerfd registered with its reactor. The runtime's own timers tick in
/// milliseconds, too coarse to space calls at tens of thousands a second. Periodic, the
/// kernel rearms it, where a timer set for each wake-up costs a system call each time.
struct Ticker {
    fd: tokio::io::unix::AsyncFd<rustix::fd::OwnedFd>,
    period: Duration,
}

impl Ticker {
    /// A timer that ticks every `period` from now on (`period` at least a nanosecond).
    fn every(period: Duration) -> std::io::Result<Ticker> {
        use rustix::time::{TimerfdClockId, TimerfdFlags, timerfd_create};
        let fd = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )?;
        // SAFETY: the descriptor is owned by the `OwnedFd` that the `AsyncFd` owns, and it
        // is never closed or replaced while registered.
        let fd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
        }?;
        let period = period.max(Duration::from_nanos(1));
        let ticker = Ticker { fd, period };
        ticker.first_in(period)?;
        Ok(ticker)
    }

    /// Tick next `wait` from now (at least a nanosecond), then every period again; ticks
    /// passed and not read are dropped.
    fn first_in(&self, wait: Duration) -> std::io::Result<()> {
        use rustix::time::{Itimerspec, TimerfdTimerFlags, Timespec, timerfd_settime};
        // A zero setting would disarm it.
        let timespec = |d: Duration| {
            Timespec::try_from(d.max(Duration::from_nanos(1))).map_err(std::io::Error::other)
        };
        let setting = Itimerspec {
            it_interval: timespec(self.period)?,
            it_value: timespec(wait)?,
        };
        timerfd_settime(self.fd.get_ref(), TimerfdTimerFlags::empty(), &setting)?;
        Ok(())
    }

    /// The next tick, or at once if ticks passed unread since the last wait (they count as
    /// one). Cancel-safe: dropped unfinished, it leaves the ticks unread.
    async fn tick(&self) -> std::io::Result<()> {
        loop {
            let mut ready = self.fd.readable().await?;
            // Reading the expiry count rearms readiness; WouldBlock means it was stale.
            match ready.try_io(|fd| Ok(rustix::io::read(fd.get_ref(), &mut [0u8; 8])?)) {
                Ok(expired) => return expired.map(drop),
                Err(_stale) => continue,
            }
        }
    }
}

/// One call a worker made.
#[derive(Debug)]
pub struct Call {
    /// When it was due: its send time in a closed loop, its slot in an open loop.
    pub due: std::time::Instant,
    pub sent: std::time::Instant,
    pub answered: std::time::Instant,
    /// A call past the worker's bound is DEADLINE_EXCEEDED with the message [`CLIENT_TIMEOUT`].
    pub answer: Result<RateLimitResponse, tonic::Status>,
}

/// What a [`worker`] sends, and what it does with the answers.
pub trait Calls: Send {
    /// The next call, once it may leave: when it was due, and the request. None ends the
    /// worker.
    fn next(
        &mut self,
    ) -> impl Future<Output = Option<(std::time::Instant, RateLimitRequest)>> + Send;
    fn record(&mut self, call: Call);
}

/// What a [`worker`] sends its calls through.
pub trait Client: Send {
    /// One ShouldRateLimit call: the answer, or the gRPC status it failed with.
    fn call(
        &mut self,
        request: RateLimitRequest,
    ) -> impl Future<Output = Result<RateLimitResponse, tonic::Status>> + Send;
}

/// Tonic's generated client, as turnstile's tests use it.
impl<S> Client for RateLimitServiceClient<S>
where
    S: tonic::client::GrpcService<tonic::body::Body> + Send,
    S::Error: Into<StdError>,
    S::Future: Send,
    S::ResponseBody: Body<Data = Bytes> + Send + 'static,
    <S::ResponseBody as Body>::Error: Into<StdError> + Send,
{
    async fn call(
        &mut self,
        request: RateLimitRequest,
    ) -> Result<RateLimitResponse, tonic::Status> {
        self.should_rate_limit(request)
            .await
            .map(tonic::Response::into_inner)
    }
}

/// A closed-loop worker, as turnstile's tests run them (each with its own samples and pace):
/// sends each call of `calls` when the one before has answered, on `clients` in turn from
/// `first`, each bounded by `timeout`. Returns `calls` when it ends.
pub async fn worker<C: Calls, K: Client>(
    mut calls: C,
    mut clients: Vec<K>,
    first: usize,
    timeout: Duration,
) -> C {
    let mut turn = first;
    while let Some((due, request)) = calls.next().await {
        let count = clients.len();
        let client = &mut clients[turn % count];
        turn = turn.wrapping_add(1);
        calls.record(timed_call(client, due, request, timeout).await);
    }
    calls
}

/// One call, sent now, bounded by `timeout`.
async fn timed_call<K: Client>(
    client: &mut K,
    due: std::time::Instant,
    request: RateLimitRequest,
    timeout: Duration,
) -> Call {
    let sent = std::time::Instant::now();
    let answer = tokio::time::timeout(timeout, client.call(request))
        .await
        .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded(CLIENT_TIMEOUT)));
    Call {
        due,
        sent,
        answered: std::time::Instant::now(),
        answer,
    }
}

/// The URI of `target`: itself, or `http://` and it when it is a bare `host:port`.
fn target_uri(target: &str) -> String {
    if target.contains("://") {
        target.to_owned()
    } else {
        format!("http://{target}")
    }
}

/// One HTTP/2 channel to `target` (`host:port`, or a URI).
pub async fn channel(target: &str) -> anyhow::Result<Channel> {
    let uri = target_uri(target);
    Endpoint::from_shared(uri.clone())
        .with_context(|| format!("invalid target {target}"))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .with_context(|| format!("cannot connect to {uri}"))
}

async fn connect(targets: &[String], per_target: usize) -> anyhow::Result<Vec<grpc::Connection>> {
    let mut clients = Vec::with_capacity(targets.len() * per_target);
    for _ in 0..per_target {
        for target in targets {
            clients.push(grpc::connect(target).await?);
        }
    }
    Ok(clients)
}

fn quantile_ms(histogram: &Histogram<u64>, q: f64) -> f64 {
    if histogram.is_empty() {
        return 0.0;
    }
    histogram.value_at_quantile(q) as f64 / 1e6
}

/// The figures of a finished run.
pub struct Report {
    pub args: BenchArgs,
    pub seconds: f64,
    pub calls: u64,
    pub ok: u64,
    pub over_limit: u64,
    pub other: u64,
    pub errors: BTreeMap<String, u64>,
    pub unsent: u64,
    /// CPU seconds used during the measured window, per process.
    pub cpu: Vec<(String, Option<f64>)>,
    latency: Histogram<u64>,
    service: Histogram<u64>,
    send_lag: Histogram<u64>,
    /// Open loop: measured calls released on time that found every place taken.
    pub waited_for_place: u64,
    /// Open loop: measured calls the generator released late (`LATE_RELEASE`).
    pub released_late: u64,
}

impl Report {
    pub fn rps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.calls as f64 / self.seconds
        } else {
            0.0
        }
    }

    /// Latency of answered calls at quantile `q`, in milliseconds.
    pub fn latency_ms(&self, q: f64) -> f64 {
        quantile_ms(&self.latency, q)
    }

    /// Service time (send to answer) at quantile `q`, in milliseconds.
    pub fn service_ms(&self, q: f64) -> f64 {
        quantile_ms(&self.service, q)
    }

    /// Open loop: how late the calls that found a place free left, at quantile `q`, in
    /// milliseconds.
    pub fn send_lag_ms(&self, q: f64) -> f64 {
        quantile_ms(&self.send_lag, q)
    }

    pub fn errors_total(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Microseconds of CPU per measured call, per process that could be read.
    pub fn cpu_us_per_call(&self) -> BTreeMap<String, f64> {
        self.cpu
            .iter()
            .filter_map(|(name, secs)| Some((name.clone(), (*secs)?)))
            .filter(|_| self.calls > 0)
            .map(|(name, secs)| (name, (secs * 1e6 / self.calls as f64 * 10.0).round() / 10.0))
            .collect()
    }

    pub fn json(&self) -> serde_json::Value {
        let a = &self.args;
        let round = |x: f64| (x * 1000.0).round() / 1000.0;
        serde_json::json!({
            "targets": a.targets,
            "mode": if a.rate.is_some() { "open" } else { "closed" },
            "rate": a.rate,
            "tick_us": a.rate.map(|_| TICK.as_micros() as u64),
            "concurrency": a.concurrency,
            "connections": a.connections,
            "keys": a.keys,
            "key_order": format!("{:?}", a.key_order).to_lowercase(),
            "descriptors": a.descriptors,
            "domain": a.domain,
            "descriptor_keys": a.descriptor_keys,
            "seconds": round(self.seconds),
            "calls": self.calls,
            "rps": round(self.rps()),
            "ok": self.ok,
            "over_limit": self.over_limit,
            "unknown": self.other,
            "errors": self.errors_total(),
            "error_kinds": self.errors,
            "unsent": self.unsent,
            "cpu_us_per_call": self.cpu_us_per_call(),
            "latency_ms": {
                "p50": round(self.latency_ms(0.5)),
                "p90": round(self.latency_ms(0.9)),
                "p99": round(self.latency_ms(0.99)),
                "p99_9": round(self.latency_ms(0.999)),
                "max": round(self.latency.max() as f64 / 1e6),
                "mean": round(self.latency.mean() / 1e6),
            },
            "service_ms": {
                "p50": round(self.service_ms(0.5)),
                "p99": round(self.service_ms(0.99)),
                "p99_9": round(self.service_ms(0.999)),
                "max": round(self.service.max() as f64 / 1e6),
            },
            "waited_for_place": self.waited_for_place,
            "released_late": self.released_late,
            "late_release_ms": a.rate.map(|_| LATE_RELEASE.as_secs_f64() * 1e3),
            "send_lag_ms": {
                "p99": round(self.send_lag_ms(0.99)),
                "p99_9": round(self.send_lag_ms(0.999)),
                "max": round(self.send_lag.max() as f64 / 1e6),
            },
        })
    }

    pub fn text(&self) -> String {
        let a = &self.args;
        let mode = match a.rate {
            Some(rate) => format!(
                "open loop at {rate:.0}/s, released every {} µs (at most {} in flight)",
                TICK.as_micros(),
                a.concurrency
            ),
            None => format!("closed loop, {} in flight", a.concurrency),
        };
        let mut out = format!(
            "turnstile-bench: {mode}, {} connection(s) to {}; domain {}, {} descriptor(s) per \
             request, {} key(s) ({:?})\n",
            a.connections * a.targets.len(),
            a.targets.join(","),
            a.domain,
            a.descriptors,
            a.keys,
            a.key_order,
        );
        let _ = writeln!(
            out,
            "{} calls in {:.2} s: {:.0} calls/s",
            self.calls,
            self.seconds,
            self.rps()
        );
        let _ = writeln!(
            out,
            "answers: OK {}, OVER_LIMIT {}, other {}, errors {}{}",
            self.ok,
            self.over_limit,
            self.other,
            self.errors_total(),
            if self.errors.is_empty() {
                String::new()
            } else {
                format!(" {:?}", self.errors)
            }
        );
        if self.unsent > 0 {
            let _ = writeln!(out, "unsent (generator fell behind): {}", self.unsent);
        }
        let _ = writeln!(
            out,
            "latency: p50 {:.3} ms, p90 {:.3} ms, p99 {:.3} ms, p99.9 {:.3} ms, max {:.3} ms",
            self.latency_ms(0.5),
            self.latency_ms(0.9),
            self.latency_ms(0.99),
            self.latency_ms(0.999),
            self.latency.max() as f64 / 1e6
        );
        if a.rate.is_some() {
            let _ = writeln!(
                out,
                "service time (send to answer): p50 {:.3} ms, p99 {:.3} ms, p99.9 {:.3} ms",
                self.service_ms(0.5),
                self.service_ms(0.99),
                self.service_ms(0.999)
            );
            let _ = writeln!(
                out,
                "sent late: {} call(s) released more than {} µs after their due time (the \
                 generator behind), {} more released on time found every place taken; those \
                 that found a place left p99 {:.3} ms, p99.9 {:.3} ms, max {:.3} ms after \
                 their due time",
                self.released_late,
                LATE_RELEASE.as_micros(),
                self.waited_for_place,
                self.send_lag_ms(0.99),
                self.send_lag_ms(0.999),
                self.send_lag.max() as f64 / 1e6
            );
        }
        let cpu = self.cpu_us_per_call();
        if !cpu.is_empty() {
            let parts: Vec<String> = cpu
                .iter()
                .map(|(name, us)| format!("{name} {us:.1} us"))
                .collect();
            let _ = writeln!(out, "CPU per call: {}", parts.join(", "));
        }
        out
    }
}

fn validate(args: &BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!args.targets.is_empty(), "--target: at least one address");
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    anyhow::ensure!(args.connections > 0, "--connections must be at least 1");
    anyhow::ensure!(args.keys > 0, "--keys must be at least 1");
    anyhow::ensure!(args.descriptors > 0, "--descriptors must be at least 1");
    anyhow::ensure!(
        !args.descriptor_keys.is_empty() && args.descriptor_keys.iter().all(|k| !k.is_empty()),
        "--key: descriptor keys must not be empty"
    );
    anyhow::ensure!(
        args.duration > Duration::ZERO && args.duration + args.warmup <= MAX_DURATION,
        "--duration (plus --warmup) must be more than 0 and at most {MAX_DURATION:?}"
    );
    if let Some(rate) = args.rate {
        anyhow::ensure!(
            rate.is_finite() && rate > 0.0 && rate <= 10_000_000.0,
            "--rate must be a positive number of calls per second (at most 10 000 000)"
        );
    }
    Ok(())
}

/// Run the load described by `args` and report what was measured.
pub async fn run(args: BenchArgs) -> anyhow::Result<Report> {
    validate(&args)?;
    let clients = connect(&args.targets, args.connections).await?;

    let start = Instant::now();
    let measure_from = start + args.warmup;
    let until = measure_from + args.duration;
    let requests = Requests {
        domain: args.domain.clone(),
        keys: args.descriptor_keys.clone(),
        prefix: args.value_prefix.clone(),
        descriptors: args.descriptors,
        cardinality: args.keys,
        order: args.key_order,
        sequence: AtomicU64::new(0),
    };

    // CPU is sampled when counting starts and once every call is done.
    let cpu_at_start = tokio::spawn({
        let watch = args.watch.clone();
        async move {
            tokio::time::sleep_until(measure_from).await;
            cpu_snapshot(&watch)
        }
    });
    let sending = Sending {
        requests,
        rng: fastrand::Rng::with_seed(fastrand::u64(..)),
        clients,
        timeout: args.timeout,
        made: 0,
    };
    // Each loop is a task of its own, on the runtime's thread with the connections' tasks:
    // run here it would be on the thread that called `block_on`, and every send and answer
    // would cross between threads.
    let measure = measure_from.into_std();
    let (total, unsent) = match args.rate {
        Some(rate) => {
            let warmup_calls = (args.warmup.as_secs_f64() * rate).ceil() as u64;
            let open = OpenLoop {
                timetable: Timetable::new(
                    start,
                    rate,
                    (args.warmup + args.duration).as_secs_f64(),
                    args.requests,
                    warmup_calls,
                ),
                concurrency: args.concurrency,
                grace: args.timeout,
            };
            tokio::spawn(open.run(sending, measure))
                .await
                .context("the open loop failed")?
                .context("the open loop's timer failed")?
        }
        None => {
            let closed = ClosedLoop {
                concurrency: args.concurrency,
                until: until.into_std(),
                cap: args.requests,
            };
            let tally = tokio::spawn(closed.run(sending, measure))
                .await
                .context("the closed loop failed")?;
            (tally, 0)
        }
    };
    // Counted calls were sent from `measure_from` on; the last of them answered by now.
    let seconds = match args.rate {
        // Open loop: the offered load spans exactly the measured timetable.
        Some(_) => args.duration.as_secs_f64(),
        None => (Instant::now().min(until + args.timeout) - measure_from).as_secs_f64(),
    };
    let cpu_at_end = cpu_snapshot(&args.watch);
    let cpu_at_start = cpu_at_start.await.context("the CPU sampler failed")?;
    let cpu = cpu_at_start
        .into_iter()
        .zip(cpu_at_end)
        .map(|((name, start), (_, end))| (name, start.zip(end).map(|(s, e)| e - s)))
        .collect();
    let calls = total.calls();
    Ok(Report {
        seconds: if args.requests > 0 && calls >= args.requests {
            (Instant::now() - measure_from).as_secs_f64()
        } else {
            seconds
        },
        calls,
        ok: total.ok,
        over_limit: total.over_limit,
        other: total.other,
        errors: total.errors,
        unsent,
        cpu,
        latency: total.latency,
        service: total.service,
        send_lag: total.send_lag,
        waited_for_place: total.waited_for_place,
        released_late: total.released_late,
        args,
    })
}

/// The `turnstile-bench` command: run, print, and fail when no call succeeded.
pub fn main(args: BenchArgs) -> anyhow::Result<Report> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if args.threads > 0 {
        builder.worker_threads(args.threads);
    }
    let runtime = builder
        .enable_all()
        .build()
        .context("cannot start the runtime")?;
    let json = args.json;
    let report = runtime.block_on(run(args))?;
    if json {
        println!("{}", report.json());
    } else {
        print!("{}", report.text());
    }
    anyhow::ensure!(
        report.ok + report.over_limit > 0,
        "no measured call was answered ({} errors, {} due but unsent)",
        report.errors_total(),
        report.unsent
    );
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watched_processes_are_name_equals_pid() {
        assert_eq!(watched("redis=42"), Ok(("redis".to_owned(), 42)));
        assert!(watched("redis").is_err());
        assert!(watched("redis=x").is_err());
    }

    #[test]
    fn own_cpu_time_is_readable_on_linux() {
        if cfg!(target_os = "linux") {
            // The reading grows while this thread works (reading it is work enough).
            let before = cpu_seconds(None).expect("this process's CPU time");
            let deadline = Instant::now() + Duration::from_secs(5);
            while cpu_seconds(None).expect("this process's CPU time") <= before {
                assert!(Instant::now() < deadline, "CPU time stuck at {before} s");
            }
        }
        assert_eq!(cpu_seconds(Some(u32::MAX)), None);
    }

    #[test]
    fn an_open_loop_schedule_counts_its_calls() {
        let start = Instant::now();
        let s = Timetable::new(start, 1000.0, 2.5, 0, 0);
        assert_eq!(s.total, 2500);
        assert_eq!(s.due(7) - s.start, Duration::from_millis(7));
        // --requests caps the measured calls, after the warm-up's.
        assert_eq!(Timetable::new(start, 1000.0, 2.5, 100, 500).total, 600);
    }

    #[test]
    fn the_timetable_releases_every_call_due_and_none_early() {
        // Rates whose interval is no whole number of nanoseconds, over a long run: the calls
        // released at a moment are due by then, and the next is not, however far into the
        // run.
        let start = std::time::Instant::now();
        for rate in [42_605.0, 30_000.0, 7.0] {
            let timetable = Timetable {
                start,
                rate,
                total: (120.0 * rate) as u64,
            };
            let mut done = 0;
            for ms in [
                0, 1, 999, 1_000, 1_001, 20_000, 59_999, 60_000, 119_999, 200_000,
            ] {
                let now = start + Duration::from_millis(ms);
                done = timetable.due_at(done, now);
                assert!(
                    done > 0 && timetable.due(done - 1) <= now,
                    "{rate}/s at {ms} ms"
                );
                if done < timetable.total {
                    assert!(timetable.due(done) > now, "{rate}/s at {ms} ms");
                }
                let expected = ((ms as f64 / 1e3 * rate).floor() as u64 + 1).min(timetable.total);
                assert!(done.abs_diff(expected) <= 1, "{rate}/s at {ms} ms: {done}");
            }
        }
    }

    #[tokio::test]
    async fn the_ticker_ticks_at_its_period_and_starts_again_when_told() {
        let period = Duration::from_millis(2);
        let ticker = Ticker::every(period).expect("a timerfd");
        let tick = || async {
            tokio::time::timeout(Duration::from_secs(5), ticker.tick())
                .await
                .expect("the timer ticks")
                .expect("the timer works")
        };
        let start = std::time::Instant::now();
        for n in 1..=5 {
            tick().await;
            let waited = start.elapsed();
            assert!(waited >= period * n, "tick {n} after {waited:?}");
        }
        // Ticks missed while busy are one tick, read at once.
        std::thread::sleep(period * 3);
        let late = std::time::Instant::now();
        tick().await;
        assert!(late.elapsed() < period, "missed ticks read at once");
        // Started again, it drops the ticks not read and waits for the new first one.
        std::thread::sleep(period * 3);
        let restart = std::time::Instant::now();
        let wait = Duration::from_millis(8);
        ticker.first_in(wait).expect("the timer restarts");
        tick().await;
        assert!(
            restart.elapsed() >= wait,
            "woke after {:?}",
            restart.elapsed()
        );
    }

    #[test]
    fn requests_draw_values_in_turn_or_uniformly() {
        let requests = |order| Requests {
            domain: "d".into(),
            keys: vec!["a".into(), "b".into()],
            prefix: "u".into(),
            descriptors: 3,
            cardinality: 2,
            order,
            sequence: AtomicU64::new(0),
        };
        let mut rng = fastrand::Rng::with_seed(1);
        let r = requests(KeyOrder::Sequential).build(&mut rng);
        let entries: Vec<(&str, &str)> = r
            .descriptors
            .iter()
            .map(|d| (d.entries[0].key.as_str(), d.entries[0].value.as_str()))
            .collect();
        assert_eq!(entries, [("a", "u0"), ("b", "u1"), ("a", "u0")]);
        let uniform = requests(KeyOrder::Uniform);
        for _ in 0..50 {
            let r = uniform.build(&mut rng);
            assert!(
                r.descriptors
                    .iter()
                    .all(|d| ["u0", "u1"].contains(&d.entries[0].value.as_str()))
            );
        }
    }
}
