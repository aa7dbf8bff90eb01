//! One Envoy's stream: the domain from its first report, per bucket the arrival time of
//! its last report (Envoy's `time_elapsed` is whole seconds, and 0 on a bucket's first
//! report, so demand is measured on arrival times), and its answers.
//!
//! Every report is answered for every bucket it lists: an unchanged share is sent unchanged,
//! which only extends Envoy's assignment (a changed one rebuilds Envoy's bucket, full).
//! When Envoy ends the stream its reservations are freed at once; when the stream breaks or
//! goes silent, they lapse a TTL after its last report, as the Envoy's assignments do.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::RateLimitStrategy;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::BlanketRule;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    BucketAction as Action, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use futures_util::Stream;
use prost::Message;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, SemaphorePermit, mpsc};
use tonic::{Request, Response, Status, Streaming};

use super::bucket::{self, Target};
use super::budget::{Budget, Charge};
use super::buffers::{Charged, hold};
use super::share::{blanket, proto_duration, token_bucket};
use super::store::{Demand, MemoryShares, ShareStore};
use super::{MAX_STREAM_BYTES, RlqsMetrics, Settings};
use crate::config::DomainRules;
use crate::config::active::ActiveRules;
use crate::decision::FailurePolicy;
use crate::edge::peers::{Caller, FromPeer, Peers, StreamOpen};
use crate::ops::metrics::{Metrics, StatsKey};

/// What a bucket's first report is taken to cover (Envoy reports every 5 s).
const FIRST_REPORT_SPAN: Duration = Duration::from_secs(5);
/// Shortest span a report's counts are divided by, so two reports in quick succession cannot
/// claim an absurd rate.
const MIN_REPORT_SPAN: Duration = Duration::from_millis(100);
/// What tracking one bucket costs besides its strings: map slots, `Seen`, string headers.
const BUCKET_COST: usize = 160;

/// Buckets the `local` failure policy tracks in this process.
const LOCAL_MAX_BUCKETS: usize = 100_000;

pub struct QuotaService {
    inner: Arc<Inner>,
}

struct Inner {
    rules: Arc<ActiveRules>,
    store: ShareStore,
    /// Shares among this process's streams only, for the `local` failure policy.
    local: MemoryShares,
    settings: Settings,
    metrics: Arc<Metrics>,
    counters: RlqsMetrics,
    /// Bytes the streams track, all together (`Settings::max_bytes`).
    tracked: Arc<Budget>,
    /// Bytes the streams' reports and answers hold (`Settings::max_buffer_bytes`).
    buffers: Arc<Budget>,
    /// A place per open stream (`Settings::max_streams`).
    open: Arc<Semaphore>,
    /// Open streams by peer address (`Settings::max_streams_per_peer`).
    peers: Peers,
}

impl QuotaService {
    pub fn new(
        rules: Arc<ActiveRules>,
        store: ShareStore,
        settings: Settings,
        metrics: Arc<Metrics>,
    ) -> QuotaService {
        QuotaService {
            inner: Arc::new(Inner {
                rules,
                store,
                local: MemoryShares::new(LOCAL_MAX_BUCKETS),
                counters: RlqsMetrics::new(&metrics),
                open: Arc::new(Semaphore::new(settings.max_streams)),
                peers: Peers::default(),
                tracked: Budget::new(settings.max_bytes),
                buffers: Budget::new(settings.max_buffer_bytes),
                settings,
                metrics,
            }),
        }
    }

    /// The gRPC service, its streams' reports counted against what their buffers may hold
    /// before tonic sets them aside; messages past `max_message` bytes are refused.
    pub fn server(
        self: &Arc<QuotaService>,
        max_message: usize,
    ) -> Charged<RateLimitQuotaServiceServer<QuotaService>> {
        let service = RateLimitQuotaServiceServer::from_arc(self.clone())
            .max_decoding_message_size(max_message);
        Charged::new(service, self.inner.buffers.clone(), max_message)
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RateLimitQuotaService for QuotaService {
    type StreamRateLimitQuotasStream = Answers;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Answers>, Status> {
        let settings = &self.inner.settings;
        let caller = request.extensions().get::<Caller>();
        let from_peer = match caller.map(|caller| caller.remote) {
            Some(peer) => {
                let share = self
                    .inner
                    .peers
                    .take(peer.ip(), settings.max_streams_per_peer);
                let Some(share) = share else {
                    return Err(Status::resource_exhausted(format!(
                        "{} RLQS streams are open from {}, the most one peer may hold \
                         (--rlqs-max-streams-per-peer)",
                        settings.max_streams_per_peer,
                        peer.ip()
                    )));
                };
                Some(share)
            }
            None => None,
        };
        let Ok(place) = self.inner.open.clone().try_acquire_owned() else {
            return Err(Status::resource_exhausted(format!(
                "{} RLQS streams are open, the most this server takes (--rlqs-max-streams)",
                settings.max_streams
            )));
        };
        // The transport asks for the next answer only once the last has gone out to the
        // client (`asked`), and a report is read only once its answer is asked for: a client
        // that does not read its answers holds one, not a queue.
        let (tx, rx) = mpsc::channel(1);
        let asked = Arc::new(Semaphore::new(0));
        let held = Held {
            _place: place,
            _from_peer: from_peer,
            _on_connection: caller.map(Caller::stream),
        };
        let outbox = Outbox {
            tx,
            asked: asked.clone(),
        };
        tokio::spawn(self.inner.clone().serve(request.into_inner(), outbox, held));
        let answers = futures_util::stream::unfold((rx, asked), |(mut rx, asked)| async move {
            asked.add_permits(1);
            rx.recv().await.map(|answer| (answer, (rx, asked)))
        });
        Ok(Response::new(Box::pin(answers)))
    }
}

/// What an open stream holds: its place among all streams, and among its peer's; and a
/// call in flight on its connection, which is then not closed to make room for another.
struct Held {
    _place: OwnedSemaphorePermit,
    _from_peer: Option<FromPeer>,
    _on_connection: Option<StreamOpen>,
}

/// Where a stream's answers go: to the transport, each once it has asked for it.
struct Outbox {
    tx: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    /// A permit each time the transport asks for the next answer.
    asked: Arc<Semaphore>,
}

/// One limited bucket as the stream knows it.
struct Seen {
    last_report: Instant,
    /// Who holds the bucket's share in the store: each of an Envoy's buckets enforces its
    /// own token bucket, so two bucket ids on one counter (`share_threshold`) hold two shares.
    holder: u64,
    /// The limit's state key, once its share is reserved.
    key: Option<String>,
}

struct StreamState {
    domain: Option<String>,
    buckets: HashMap<Vec<(String, String)>, Seen>,
    /// What `buckets` costs, counted as `MAX_STREAM_BYTES` counts it.
    bytes: usize,
}

impl Inner {
    async fn serve(
        self: Arc<Self>,
        mut reports: Streaming<RateLimitQuotaUsageReports>,
        outbox: Outbox,
        held: Held,
    ) {
        self.counters.streams.increment(1.0);
        let mut state = StreamState {
            domain: None,
            buckets: HashMap::new(),
            bytes: 0,
        };
        // What the answers' buffers hold: the transport's encoder keeps the largest.
        let mut answers = Charge::new(self.buffers.clone());
        let closed_by_envoy = loop {
            tokio::select! {
                asked = outbox.asked.acquire() => asked.map_or((), SemaphorePermit::forget),
                () = outbox.tx.closed() => break false,
            }
            let report = tokio::select! {
                report = reports.message() => report,
                () = outbox.tx.closed() => break false,
            };
            let answer = match report {
                Ok(Some(report)) => self.answer(&mut state, report).await,
                Ok(None) => break true,
                Err(status) => Err(status),
            };
            let (answer, last) = match answer {
                Ok(None) => {
                    // Nothing sent: the transport's ask stands for the next answer.
                    outbox.asked.add_permits(1);
                    continue;
                }
                Ok(Some(answer)) => match hold(&mut answers, "an answer", answer.encoded_len()) {
                    Ok(()) => (Ok(answer), false),
                    Err(refused) => (Err(refused), true),
                },
                Err(status) => {
                    tracing::debug!(%status, "RLQS stream ended");
                    (Err(status), true)
                }
            };
            if outbox.tx.send(answer).await.is_err() || last {
                break false;
            }
        };
        if closed_by_envoy {
            for seen in state.buckets.values() {
                let Some(key) = seen.key.as_deref() else {
                    continue;
                };
                if let Err(error) = self.store.leave(key, seen.holder).await {
                    tracing::debug!(%error, "RLQS reservation left to expire");
                }
                self.local.leave(key, seen.holder);
            }
            self.tracked.give_back(state.bytes);
        } else if state.bytes > 0 {
            // Its shares stand in the store until they lapse: so do their bytes here (the
            // count only: the buckets themselves are freed now).
            let (tracked, bytes, ttl) = (self.tracked.clone(), state.bytes, self.settings.ttl);
            tokio::spawn(async move {
                tokio::time::sleep(ttl).await;
                tracked.give_back(bytes);
            });
        }
        self.counters.streams.decrement(1.0);
        // Free before the answers end (`tx`), so that Envoy's next stream finds them free.
        drop((held, state, reports, answers));
        drop(outbox);
    }

    /// The answer to one report: an action for every bucket it lists, unless the failure
    /// policy says to leave them be. A stream whose first report names no domain is refused.
    async fn answer(
        &self,
        state: &mut StreamState,
        report: RateLimitQuotaUsageReports,
    ) -> Result<Option<RateLimitQuotaResponse>, Status> {
        let now = Instant::now();
        let domain = match &state.domain {
            Some(domain) => domain.clone(),
            None => {
                let domain = report.domain;
                if domain.is_empty() || domain.len() > self.settings.bounds.max_descriptor_bytes {
                    return Err(Status::invalid_argument(
                        "the stream's first report must name the domain (at most max_bytes)",
                    ));
                }
                state.domain = Some(domain.clone());
                domain
            }
        };
        let loaded = self.rules.current();
        let rules = loaded.rules.domain(&domain);
        if rules.is_none() {
            self.metrics.domain_not_found(&domain);
        }
        let mut actions = Vec::with_capacity(report.bucket_quota_usages.len());
        for usage in report.bucket_quota_usages {
            let Some(bucket_id) = usage.bucket_id.clone() else {
                continue;
            };
            self.counters.reports.increment(1);
            if let Some(action) = self.bucket(state, rules, &bucket_id, &usage, now).await {
                actions.push(BucketAction {
                    bucket_id: Some(bucket_id),
                    bucket_action: Some(action),
                });
            }
        }
        Ok((!actions.is_empty()).then_some(RateLimitQuotaResponse {
            bucket_action: actions,
        }))
    }

    /// One bucket's action, echoing Envoy's bucket id exactly.
    async fn bucket(
        &self,
        state: &mut StreamState,
        rules: Option<&DomainRules>,
        bucket_id: &BucketId,
        usage: &BucketQuotaUsage,
        now: Instant,
    ) -> Option<Action> {
        let entries = bucket::entries(&bucket_id.bucket, &self.settings.bounds);
        let target = match (rules, &entries) {
            (Some(rules), Some(entries)) => bucket::target(rules, entries),
            _ => Target::Uncovered,
        };
        let usage_of = |stats_key: &str| {
            let counters = self.metrics.rule(&StatsKey::Rule(stats_key));
            let (allowed, denied) = (usage.num_requests_allowed, usage.num_requests_denied);
            self.metrics.record_usage(&counters, allowed, denied);
        };
        let (key, limit) = match target {
            // Not limited, as a descriptor no rule covers: allowed, and nothing is kept. (An
            // abandoned bucket is re-created by Envoy 1.40 at its next request and reported
            // at once: a report per request.)
            Target::Uncovered => return Some(self.assign(blanket(BlanketRule::AllowAll))),
            Target::Unlimited { stats_key } => {
                usage_of(stats_key);
                return Some(self.assign(blanket(BlanketRule::AllowAll)));
            }
            Target::Limited {
                key,
                limit,
                stats_key,
            } => {
                usage_of(stats_key);
                (key, limit)
            }
        };
        let owned: Vec<(String, String)> = entries
            .iter()
            .flatten()
            .map(|&(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        if !state.buckets.contains_key(&owned) {
            let cost = BUCKET_COST
                + key.len()
                + owned.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
            if state.bytes + cost > MAX_STREAM_BYTES || !self.tracked.take(cost) {
                // Untracked, a limited bucket cannot be given a share; nor let through.
                return Some(self.assign(blanket(BlanketRule::DenyAll)));
            }
            state.bytes += cost;
        }
        let seen = state.buckets.entry(owned).or_insert_with(|| Seen {
            last_report: now - FIRST_REPORT_SPAN,
            holder: fastrand::u64(..),
            key: None,
        });
        let span = now.duration_since(seen.last_report).max(MIN_REPORT_SPAN);
        seen.last_report = now;
        let requests = usage
            .num_requests_allowed
            .saturating_add(usage.num_requests_denied);
        let demand = Demand {
            key: &key,
            holder: seen.holder,
            demand: requests as f64 * limit.window as f64 / span.as_secs_f64(),
            limit: u64::from(limit.requests_per_unit),
        };
        let ttl = self.settings.ttl;
        let share = match self.store.share(demand, ttl).await {
            Ok(share) => share,
            Err(error) => {
                self.metrics.backend_error(&error);
                let policy = rules
                    .and_then(DomainRules::on_backend_error)
                    .unwrap_or(self.settings.on_backend_error);
                tracing::debug!(%error, %policy, "RLQS store failed; answering by policy");
                match policy {
                    FailurePolicy::Allow => {
                        return Some(self.assign(blanket(BlanketRule::AllowAll)));
                    }
                    FailurePolicy::Deny => return Some(self.assign(blanket(BlanketRule::DenyAll))),
                    // Envoy keeps its assignment until the TTL, then its expired behaviour.
                    FailurePolicy::Error => {
                        self.counters.unanswered.increment(1);
                        return None;
                    }
                    FailurePolicy::Local => match self.local.share_now(demand, ttl) {
                        Ok(share) => share,
                        Err(_) => return Some(self.assign(blanket(BlanketRule::DenyAll))),
                    },
                }
            }
        };
        seen.key = Some(key.clone());
        Some(self.assign(token_bucket(&limit, share)))
    }

    fn assign(&self, strategy: RateLimitStrategy) -> Action {
        use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy;
        let counter = match strategy.strategy {
            Some(Strategy::TokenBucket(_)) => &self.counters.token_bucket,
            Some(Strategy::BlanketRule(rule)) if rule == BlanketRule::DenyAll as i32 => {
                &self.counters.deny_all
            }
            _ => &self.counters.allow_all,
        };
        counter.increment(1);
        Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(proto_duration(self.settings.ttl)),
            rate_limit_strategy: Some(strategy),
        })
    }
}
