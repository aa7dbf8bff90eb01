//! Concurrent load against running turnstile instances, and what to read from it.
//!
//! A load is a number of streams, each a closed-loop worker of the load generator
//! (`turnstile_bench::worker`) calling ShouldRateLimit over and over on one target (a gRPC
//! channel to one instance, with the request to send). What only the tests need is here: every
//! call kept as a sample (when it was sent and answered, what it said), a pace between calls,
//! and a stop. Every load is bounded twice: a total number of calls and a duration; every
//! call is bounded by a client-side timeout.
//!
//! The time checks below are conservative: a decision is taken somewhere between a call's
//! `sent` and `answered`, so a set of admissions is known to fall inside an interval only when
//! all of their [sent, answered] spans do.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tokio::task::JoinSet;
use tonic::transport::Channel;
use turnstile_bench::{Call, Calls};

/// What one call got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Overall OK, with each status's `limit_remaining`.
    Ok(Vec<u32>),
    /// Overall OVER_LIMIT, with each status's `limit_remaining`.
    OverLimit(Vec<u32>),
    /// A gRPC error (a transport failure shows as UNAVAILABLE or UNKNOWN; a client-side
    /// timeout as DEADLINE_EXCEEDED with the message `turnstile_bench::CLIENT_TIMEOUT`).
    Failed(tonic::Code, String),
}

impl Answer {
    pub fn from_result(result: Result<RateLimitResponse, tonic::Status>) -> Answer {
        match result {
            Ok(response) => {
                let remaining = response
                    .statuses
                    .iter()
                    .map(|s| s.limit_remaining)
                    .collect();
                match Code::try_from(response.overall_code) {
                    Ok(Code::Ok) => Answer::Ok(remaining),
                    Ok(Code::OverLimit) => Answer::OverLimit(remaining),
                    other => Answer::Failed(
                        tonic::Code::Internal,
                        format!("unexpected overall_code {other:?}"),
                    ),
                }
            }
            Err(status) => Answer::Failed(status.code(), status.message().to_owned()),
        }
    }

    pub fn admitted(&self) -> bool {
        matches!(self, Answer::Ok(_))
    }

    pub fn failed(&self) -> bool {
        matches!(self, Answer::Failed(..))
    }

    /// The first status's `limit_remaining`, for answers that have one.
    pub fn remaining(&self) -> Option<u32> {
        match self {
            Answer::Ok(r) | Answer::OverLimit(r) => r.first().copied(),
            Answer::Failed(..) => None,
        }
    }
}

/// One call.
#[derive(Debug, Clone)]
pub struct Sample {
    /// The target's `id`.
    pub target: usize,
    pub sent: Instant,
    pub answered: Instant,
    pub answer: Answer,
}

impl Sample {
    pub fn latency(&self) -> Duration {
        self.answered - self.sent
    }
}

/// Where a stream sends its calls.
#[derive(Clone)]
pub struct Target {
    pub id: usize,
    pub channel: Channel,
    pub request: RateLimitRequest,
}

#[derive(Clone)]
pub struct Spec {
    /// Stream `i` calls `targets[i % targets.len()]`.
    pub targets: Vec<Target>,
    pub streams: usize,
    /// Pause of a stream between its calls (zero: flat out).
    pub pace: Duration,
    /// Bound on the calls of the whole load.
    pub max_calls: usize,
    /// Bound on the duration of the whole load.
    pub max_time: Duration,
    /// Client-side bound on one call.
    pub call_timeout: Duration,
}

impl Spec {
    pub fn new(targets: Vec<Target>, streams: usize) -> Spec {
        Spec {
            targets,
            streams,
            pace: Duration::ZERO,
            max_calls: 100_000,
            max_time: Duration::from_secs(10),
            call_timeout: Duration::from_secs(5),
        }
    }
}

/// One stream's side of a generator worker: the same request until a bound or the stop,
/// every answer kept as a sample.
struct Stream {
    target: usize,
    request: RateLimitRequest,
    pace: Duration,
    /// Whether a call was made already (the pace comes between calls).
    paced: bool,
    deadline: Instant,
    max_calls: usize,
    calls: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
}

impl Calls for Stream {
    async fn next(&mut self) -> Option<(Instant, RateLimitRequest)> {
        if std::mem::replace(&mut self.paced, true) && !self.pace.is_zero() {
            tokio::time::sleep(self.pace).await;
        }
        let go = !self.stop.load(Ordering::Relaxed)
            && Instant::now() < self.deadline
            && self.calls.fetch_add(1, Ordering::Relaxed) < self.max_calls;
        go.then(|| (Instant::now(), self.request.clone()))
    }

    fn record(&mut self, call: Call) {
        let sample = Sample {
            target: self.target,
            sent: call.sent,
            answered: call.answered,
            answer: Answer::from_result(call.answer),
        };
        self.samples
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(sample);
    }
}

pub struct Load {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    tasks: JoinSet<()>,
    pub started: Instant,
}

impl Load {
    pub fn start(spec: Spec) -> Load {
        assert!(!spec.targets.is_empty() && spec.streams > 0);
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let calls = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let deadline = started + spec.max_time;
        let call_timeout = spec.call_timeout;
        let mut tasks = JoinSet::new();
        for stream in 0..spec.streams {
            let target = &spec.targets[stream % spec.targets.len()];
            let plan = Stream {
                target: target.id,
                request: target.request.clone(),
                pace: spec.pace,
                paced: false,
                deadline,
                max_calls: spec.max_calls,
                calls: calls.clone(),
                stop: stop.clone(),
                samples: samples.clone(),
            };
            let client = RateLimitServiceClient::new(target.channel.clone());
            tasks.spawn(async move {
                turnstile_bench::worker(plan, vec![client], 0, call_timeout).await;
            });
        }
        Load {
            stop,
            samples,
            tasks,
            started,
        }
    }

    /// The calls answered so far.
    pub fn snapshot(&self) -> Vec<Sample> {
        self.samples
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// How many calls were answered so far.
    pub fn answered(&self) -> usize {
        self.samples
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Stop the streams (each finishes its call in flight) and return every sample, ordered by
    /// the time it was sent.
    pub async fn stop(mut self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        self.join().await
    }

    /// Wait until the streams end by their own bounds; every sample, ordered by sending time.
    pub async fn finish(mut self) -> Vec<Sample> {
        self.join().await
    }

    async fn join(&mut self) -> Vec<Sample> {
        while let Some(joined) = self.tasks.join_next().await {
            joined.expect("a load stream panicked");
        }
        let mut samples =
            std::mem::take(&mut *self.samples.lock().unwrap_or_else(PoisonError::into_inner));
        samples.sort_by_key(|s| s.sent);
        samples
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.tasks.abort_all();
    }
}

/// Serialises the timing-sensitive tests of one test binary: on 2 cores, two loads at once
/// would measure each other.
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    SERIAL.lock().await
}

/// The largest ratio `k / bound(span)` over every set of k admissions known to lie inside an
/// interval of length `span` (all their [sent, answered] spans inside it), considering only
/// spans for which `bound` returns Some. With `bound` the most the algorithm may admit in an
/// interval of that length, a ratio above 1 proves over-admission. Also returns the k and
/// span that reached it. O(n² log n): meant for a few thousand admissions.
pub fn max_ratio(
    admissions: &[(Instant, Instant)],
    bound: impl Fn(Duration) -> Option<f64>,
) -> (f64, usize, Duration) {
    let mut sorted = admissions.to_vec();
    sorted.sort_by_key(|(sent, _)| *sent);
    let mut best = (0.0, 0, Duration::ZERO);
    for (i, &(start, _)) in sorted.iter().enumerate() {
        let mut ends: Vec<Instant> = sorted[i..].iter().map(|&(_, answered)| answered).collect();
        ends.sort();
        for (k, end) in ends.iter().enumerate() {
            let span = *end - start;
            if let Some(most) = bound(span) {
                let ratio = (k + 1) as f64 / most;
                if ratio > best.0 {
                    best = (ratio, k + 1, span);
                }
            }
        }
    }
    best
}

/// The `q` quantile (0..=1) of `values`; zero when empty.
pub fn quantile(values: &[Duration], q: f64) -> Duration {
    if values.is_empty() {
        return Duration::ZERO;
    }
    let mut sorted = values.to_vec();
    sorted.sort();
    let index = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[index]
}
