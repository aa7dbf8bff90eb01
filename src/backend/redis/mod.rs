//! The Redis backend: limit state in Redis (one server, a Sentinel-managed master or a
//! Cluster), every decision taken by one Lua script on Redis time, so any number of turnstile
//! instances share exact counts.
//!
//! A request is decided by the batch script (`lua/batch.lua`) over all of its hits in one
//! call, which makes it atomic; requests that arrive together share a call (`coalesce`), each
//! decided on its own. On a Cluster, hits whose limits live in different slots cannot share a
//! script call; `cluster` reserves them per slot and refunds the reservation when the request
//! is refused as a whole. Each thread serving gRPC writes and reads its own calls, on
//! connections of its own (`threads`).

mod client;
mod clock;
mod cluster;
mod coalesce;
mod connect;
mod eviction;
mod layout;
mod mailbox;
mod script;
mod sentinel;
mod slice;
mod slot_watch;
mod threads;
mod twins;

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ::redis::cluster_routing::Slot;
use ::redis::{RedisError, RedisResult};
use tokio::runtime::Handle;

use super::{Backend, BackendError, Charging, Hit, Outcome};
use crate::algorithm::Micros;
use crate::decision::deadline::Deadline;
use crate::ops::metrics::Metrics;
use clock::Clock;
use coalesce::Lanes;
use connect::Pool;
pub use layout::KeyLayout;
pub use script::{Lua, batch_library, batch_source};
use script::{Mode, Nonce, Part};
use threads::{ThreadConnections, run_on};

/// How the configured URLs reach the master(s) that hold the state.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum RedisMode {
    /// One server; `urls` holds exactly one URL.
    #[default]
    Single,
    /// `urls` are Sentinels that name the current master of `master`; a failover is followed
    /// by asking them again.
    Sentinel { master: String },
    /// `urls` are seed nodes of a Redis Cluster; the topology is discovered from them.
    Cluster,
}

/// Where and how to reach Redis.
#[derive(Clone)]
pub struct RedisConfig {
    /// `redis://` or `rediss://` (TLS) URLs, with optional `user:password@` and `/db`; a bare
    /// `host:port` means `redis://host:port`. Single: one server. Sentinel: the Sentinels
    /// (their credentials, database and TLS also apply to the master they name). Cluster: seed
    /// nodes. Default: `redis://127.0.0.1:6379`.
    pub urls: Vec<String>,
    /// Default: [`RedisMode::Single`].
    pub mode: RedisMode,
    /// Multiplexed connections used round-robin (per node on a Cluster; at least 1), and the
    /// script calls in flight per server (per slot on a Cluster) when coalescing; each thread
    /// serving gRPC has as many of its own, and the I/O thread as many again. Default: 2.
    pub connections: usize,
    /// Most requests decided by one script call: requests that arrive while calls are in
    /// flight share the next one (see `coalesce`). 1: every request is a call of its own.
    /// Default: 64.
    pub batch: usize,
    /// Bound on establishing a connection (and on `connect` as a whole). Default: 1 s.
    pub connect_timeout: Duration,
    /// Where fixed-window counters live: turnstile's keys, or the reference's (to share
    /// counters with it during a migration). Default: turnstile's.
    pub key_layout: KeyLayout,
    /// Bound on every `evaluate` (and `ready`) call: a call Redis has not answered this long
    /// after it was written fails with [`BackendError::Timeout`]; a request whose caller waited
    /// this long mostly in turnstile's own queue, with [`BackendError::Late`]. Default: 25 ms.
    pub call_timeout: Duration,
    /// Replicas every script call's writes must reach before its answer counts (see
    /// [`Wait`]). Default: none.
    pub wait: Option<Wait>,
    /// Prepended to every key, outside the hash tag; must not contain braces. Default: "".
    pub key_prefix: String,
    /// Certificates for `rediss://` URLs beyond the system's roots (single and Cluster).
    pub tls: RedisTls,
    /// Credentials for URLs that carry none: `password` or `user:password` (REDIS_AUTH).
    pub auth: Option<String>,
    /// Bare `host:port` addresses use TLS (REDIS_TLS).
    pub tls_by_default: bool,
    /// The I/O thread's scheduler slice, which sets how soon it runs when woken (see
    /// `slice`); the thread is the process's, shared by its backends. None: left as it is
    /// (the kernel's default). Default: 100 µs.
    pub io_slice: Option<Duration>,
}

/// Durability of charges: after each script call, on its connection, `WAIT` for `replicas`
/// replicas for at most `timeout`. A failover to one of them then loses none of the call's
/// charges; a call fewer replicas acknowledged in time fails (the failure policy answers its
/// requests, although the master has charged them: counted twice rather than lost).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    pub replicas: u32,
    pub timeout: Duration,
}

/// PEM certificates for TLS to Redis.
#[derive(Clone, Default)]
pub struct RedisTls {
    /// A CA to trust instead of the system's roots.
    pub ca: Option<Vec<u8>>,
    /// A client certificate and key, for servers that require one (`tls-auth-clients yes`).
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl Default for RedisConfig {
    fn default() -> Self {
        RedisConfig {
            urls: vec!["redis://127.0.0.1:6379".into()],
            mode: RedisMode::Single,
            connections: 2,
            batch: 64,
            connect_timeout: Duration::from_secs(1),
            call_timeout: Duration::from_millis(25),
            wait: None,
            key_prefix: String::new(),
            key_layout: KeyLayout::Turnstile,
            tls: RedisTls::default(),
            auth: None,
            tls_by_default: false,
            io_slice: Some(Duration::from_micros(100)),
        }
    }
}

// URLs may carry passwords: print them redacted.
impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let urls: Vec<String> = self.urls.iter().map(|u| client::redact(u)).collect();
        f.debug_struct("RedisConfig")
            .field("urls", &urls)
            .field("mode", &self.mode)
            .field("connections", &self.connections)
            .field("batch", &self.batch)
            .field("connect_timeout", &self.connect_timeout)
            .field("call_timeout", &self.call_timeout)
            .field("wait", &self.wait)
            .field("key_prefix", &self.key_prefix)
            .field("key_layout", &self.key_layout)
            .field("tls_ca", &self.tls.ca.is_some())
            .field("tls_client", &self.tls.client.is_some())
            .field("auth", &self.auth.as_ref().map(|_| "***"))
            .field("tls_by_default", &self.tls_by_default)
            .finish()
    }
}

/// Limit state in Redis. Cheap to clone: clones share the connections.
#[derive(Clone)]
pub struct RedisBackend {
    connections: Arc<ThreadConnections>,
}

/// One runtime's connections to Redis and what its calls share (`threads`: a serving thread's
/// own, or the I/O thread's), with the tasks it spawns (cluster reservations).
struct Shared {
    /// The runtime that drives `pool`, runs the calls and times them.
    runtime: Handle,
    pool: Pool,
    /// How the batch script runs on the pool's servers.
    runner: Arc<script::Runner>,
    lanes: Lanes,
    call_timeout: Duration,
    /// Replicas each script call waits for.
    wait: Option<Wait>,
    /// Bound on script calls that must finish even after the caller gave up (refunds).
    cleanup_timeout: Duration,
    key_prefix: String,
    key_layout: KeyLayout,
    clock: Arc<Clock>,
}

/// What one runtime's calls learn of the servers, which every runtime's calls share: how the
/// batch script runs there, Redis' clock, and where the master is.
#[derive(Clone, Default)]
struct Learned {
    runner: Arc<script::Runner>,
    clock: Arc<Clock>,
    /// How many times the backend switched to a new server that answers (a failover
    /// followed): see [`RedisBackend::switches`].
    switches: Arc<AtomicU64>,
    /// Under Sentinel, the watch on the master, started by the first pool.
    sentinel: Arc<tokio::sync::OnceCell<Arc<sentinel::SentinelWatch>>>,
    /// On a Cluster, the watch on the slot map, started by the first pool.
    slots: Arc<tokio::sync::OnceCell<Option<Arc<slot_watch::SlotWatch>>>>,
}

impl RedisBackend {
    /// Connect (within `connect_timeout`) and check that Redis answers.
    pub async fn connect(config: &RedisConfig) -> Result<RedisBackend, BackendError> {
        if config.key_prefix.contains(['{', '}']) {
            return Err(BackendError::Unavailable(
                "the Redis key prefix must not contain braces (they would move the hash tag)"
                    .into(),
            ));
        }
        let connections = ThreadConnections::connect(config).await?;
        if let Some(slice) = config.io_slice {
            slice::give_io_thread(slice);
        }
        Ok(RedisBackend { connections })
    }
}

impl Shared {
    /// Connect on the runtime this runs on, which then drives what it opens.
    async fn open(config: &RedisConfig, learned: Learned) -> Result<Shared, BackendError> {
        let pool = Pool::connect(config, &learned).await?;
        Ok(Shared {
            runtime: Handle::current(),
            pool,
            runner: learned.runner,
            lanes: Lanes::new(config.batch, config.connections),
            call_timeout: config.call_timeout,
            wait: config.wait,
            cleanup_timeout: config.call_timeout + config.connect_timeout,
            key_prefix: config.key_prefix.clone(),
            key_layout: config.key_layout,
            clock: learned.clock,
        })
    }
}

impl RedisBackend {
    /// Read what Redis does once full now and every minute, for as long as this backend
    /// lives: logged, and shown in `turnstile_redis_evicts_when_full` (see `eviction`).
    pub fn watch_eviction(&self, metrics: Arc<Metrics>) {
        eviction::watch(Arc::downgrade(self.connections.io()), metrics);
    }

    /// Run a script of another module on `<prefix>{<identity>}<suffix>`: a key in the Cluster
    /// slot of the limit whose state key is `identity`. Bounded by the call timeout.
    pub async fn eval(
        &self,
        lua: &Lua,
        identity: &str,
        suffix: &str,
        args: &[String],
    ) -> Result<i64, BackendError> {
        let shared = self.connections.here();
        let key = layout::tagged(&shared.key_prefix, identity) + suffix;
        let args = args.to_vec();
        let lua = lua.clone();
        run_on(shared.runtime.clone(), async move {
            let call = script::run_lua(&shared.pool, &lua, &key, &args);
            shared.bounded(shared.call_timeout, call).await
        })
        .await
    }
}

impl Shared {
    fn redis_key(&self, hit: &Hit) -> String {
        self.key_layout.key(&self.key_prefix, &hit.key, &hit.limit)
    }

    /// The lane a part's call goes in: its slot on a Cluster, the one server otherwise.
    fn slot(&self, part: &Part) -> Option<Slot> {
        self.pool
            .is_cluster()
            .then(|| part.first_key().map(Slot::for_key))
            .flatten()
    }

    /// A command bounded by `bound`, run on its runtime. No reply in time is
    /// [`BackendError::Timeout`], unless this process's own lag explains the wait
    /// ([`Shared::within`]): then [`BackendError::Late`].
    async fn bounded<T>(
        &self,
        bound: Duration,
        command: impl Future<Output = RedisResult<T>>,
    ) -> Result<T, BackendError> {
        match self.within(bound, command).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(err)) => {
                self.pool.trouble(&err);
                Err(backend_error(&err))
            }
            Err(Expired::WaitedForUs) => Err(BackendError::Late),
            Err(Expired::Slow) => {
                self.pool.timed_out();
                Err(BackendError::Timeout)
            }
        }
    }

    /// `work`'s output within `bound`, or why not. When the wait ran out while the process was
    /// kept from running (a paused host, a starved thread: its runtime's lag explains the
    /// wait, or this timer itself went off over half a bound late), Redis has most likely
    /// answered meanwhile, its reply unread: `work` gets one more `bound`, timed on a running
    /// process. Failing at once would answer by policy a request Redis decided, and charged,
    /// in time.
    async fn within<F: Future>(&self, bound: Duration, work: F) -> Result<F::Output, Expired> {
        let mut work = std::pin::pin!(work);
        let mut waited_for_us = false;
        loop {
            let started = Instant::now();
            if let Ok(output) = tokio::time::timeout(bound, &mut work).await {
                return Ok(output);
            }
            if !(self.lanes.lag.explains(bound) || started.elapsed() > bound + bound / 2) {
                return Err(Expired::Slow);
            }
            if waited_for_us {
                return Err(Expired::WaitedForUs);
            }
            waited_for_us = true;
        }
    }

    /// When the caller of a call starting now stops waiting: its own deadline (the service
    /// always sets one), else the call timeout. Time queued here counts against the caller's
    /// deadline only; a call, once written, is bounded by the call timeout, so a timeout
    /// measures Redis and not turnstile's own queue.
    fn deadline(&self) -> Deadline {
        Deadline::current().unwrap_or_else(|| Deadline::after(self.call_timeout))
    }
}

/// Why [`Shared::within`] gave up waiting.
enum Expired {
    /// The last wait too was this process's own lag.
    WaitedForUs,
    /// The awaited side was slow while this process ran.
    Slow,
}

fn backend_error(err: &RedisError) -> BackendError {
    match err.code() {
        Some("OOM") => BackendError::Full(err.to_string()),
        _ => BackendError::Unavailable(err.to_string()),
    }
}

impl RedisBackend {
    /// `Backend::evaluate` at the time `now` instead of Redis TIME, so a test can run the
    /// scripts and the memory backend on one controlled clock. The server never calls it:
    /// every request goes through `Backend::evaluate`, which always decides on Redis time.
    pub async fn evaluate_at(
        &self,
        hits: &[Hit],
        charging: Charging,
        now: Micros,
    ) -> Result<Vec<Outcome>, BackendError> {
        self.evaluate_on(hits, charging, Some(now)).await
    }

    async fn evaluate_on(
        &self,
        hits: &[Hit],
        charging: Charging,
        at: Option<Micros>,
    ) -> Result<Vec<Outcome>, BackendError> {
        if hits.is_empty() {
            return Ok(Vec::new());
        }
        let shared = &self.connections.here();
        let deadline = shared.deadline();
        let keys: Vec<String> = hits.iter().map(|h| shared.redis_key(h)).collect();
        if shared.pool.is_cluster() {
            let groups = cluster::group_by_slot(&keys);
            if groups.len() > 1 {
                let job = cluster::Job::new(
                    shared.clone(),
                    hits,
                    keys,
                    groups,
                    charging,
                    Nonce::new(),
                    at,
                );
                let job = job.until(deadline);
                return job.evaluate().await;
            }
        }
        let mode = match charging {
            Charging::Atomic => Mode::Atomic,
            Charging::PerDescriptor => Mode::PerDescriptor,
            Charging::Nothing => Mode::Check,
        };
        let mut part = Part::new(mode, Nonce::new());
        for (key, hit) in keys.into_iter().zip(hits) {
            part.push(key, hit, hit.units, None, shared.key_layout);
        }
        let slot = shared.slot(&part);
        let replies =
            coalesce::call(shared, slot, part, at, Some(deadline), shared.call_timeout).await?;
        Ok(replies.into_iter().map(|r| r.outcome).collect())
    }
}

impl Backend for RedisBackend {
    async fn evaluate(
        &self,
        hits: &[Hit],
        charging: Charging,
    ) -> Result<Vec<Outcome>, BackendError> {
        self.evaluate_on(hits, charging, None).await
    }

    async fn ready(&self) -> bool {
        let shared = self.connections.here();
        let ping = run_on(shared.runtime.clone(), async move {
            let ping = ::redis::cmd("PING");
            let reply = shared.pool.query::<String>(&ping);
            shared.bounded(shared.call_timeout, reply).await
        });
        ping.await.is_ok()
    }

    fn switches(&self) -> u64 {
        self.connections.learned().switches.load(Ordering::Acquire)
    }
}
