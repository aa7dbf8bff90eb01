//! Start-up and shutdown, in the order `serve` reads: load the rules (and keep them current),
//! build the backend, build the service, serve the ports, wait for SIGTERM/SIGINT, drain.
//! Each part takes its group of flags whole (`app::cli`). Connections are accepted by
//! `edge::connections`, within caps that fit the open-files limit.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use tokio::sync::{Semaphore, watch};
use tonic::service::Routes;

use crate::app::cli::{
    BackendArgs, BackendKind, ConfigType, ObservabilityArgs, PolicyArg, RedisArgs, RuleSourceArgs,
    ServeArgs,
};
use crate::app::ports::{self, Service};
use crate::backend::Backend;
use crate::backend::deferred::Deferred;
use crate::backend::memory::MemoryBackend;
use crate::backend::redis::RedisBackend;
use crate::backend::stack::{self, MemoryStack, RedisStack, StackConfig};
use crate::config::active::ActiveRules;
use crate::config::reload::Reloader;
use crate::config::{RuleSet, Source, xds_client};
use crate::edge::health::{Health, Requirements};
use crate::ops::metrics::Metrics;
use crate::ops::rules_series::RulesSeries;
use crate::ops::statsd::StatsdRecorder;
use crate::rlqs::{self, MemoryShares, ShareStore};
use crate::service::RateLimiter;
use crate::service::fallback::Fallback;

/// Keys with quota leases held at once by one instance.
const MAX_LEASE_POOLS: usize = 100_000;
/// Often, so that each fold of latency samples is short (a thread serving calls on the same
/// CPU waits it out).
const METRICS_UPKEEP_PERIOD: Duration = Duration::from_millis(50);
const BACKEND_PROBE_PERIOD: Duration = Duration::from_secs(1);
const MEMORY_SWEEP_PERIOD: Duration = Duration::from_secs(1);

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let start = load_rules(&args.rules)?;
    let metrics = metrics(&args.observability).await?;
    let (rules, feed) = keep_rules_current(start, &args.rules, &metrics)?;
    let stack = StackConfig {
        breaker: args.failure.breaker(),
        over_limit_entries: args.backend.over_limit_entries(),
        max_leases: MAX_LEASE_POOLS,
    };
    match args.backend.kind() {
        BackendKind::Memory => {
            let (backend, shares) = memory_backend(&args.backend, &stack, &metrics);
            run(backend, shares, &args, rules, feed, metrics).await
        }
        BackendKind::Redis => {
            let (backend, shares) = redis_backend(&args.backend.redis, &stack, &metrics)?;
            run(backend, shares, &args, rules, feed, metrics).await
        }
    }
}

/// Everything after the backend is built: the same for every backend.
async fn run<B: Backend>(
    backend: B,
    shares: ShareStore,
    args: &ServeArgs,
    rules: Arc<ActiveRules>,
    feed: Feed,
    metrics: Arc<Metrics>,
) -> anyhow::Result<()> {
    let watcher = tokio::spawn(feed);
    let service = build_service(backend, shares, args, rules, &metrics);
    let probe = tokio::spawn(probe_backend(&service));
    let ports = ports::bind_ports(args, &service, &metrics).await?;
    let (stop, stopped) = watch::channel(false);
    let grpc = ports::serve_grpc(ports.grpc, ports.caps, args, &service, &metrics, &stopped)?;
    let http = ports::serve_http(ports.http, ports.caps, args, &metrics, &stopped);
    let shutdown = wait_for_shutdown(&service.health, stop);
    drain(grpc, http, shutdown, args.shutdown_grace).await?;
    probe.abort();
    watcher.abort();
    tracing::info!("stopped");
    Ok(())
}

/// Health follows the backend (and the rules), probed every period.
fn probe_backend<B: Backend>(service: &Service<B>) -> impl Future<Output = ()> + use<B> {
    let (health, limiter) = (service.health.clone(), service.limiter.clone());
    async move {
        health
            .watch_backend(limiter.backend(), BACKEND_PROBE_PERIOD)
            .await
    }
}

/// The rules at start-up: loaded from files, or to come from a control plane.
enum Start {
    Files { source: Source, rules: RuleSet },
    Xds(Box<xds_client::Settings>),
}

/// Keeps the rules current: the file watcher, or the xDS client.
type Feed = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Rule files that do not load stop the start, every error listed; for xDS, only its
/// settings are checked here (the rules come later).
fn load_rules(args: &RuleSourceArgs) -> anyhow::Result<Start> {
    match args.config_type {
        ConfigType::File => {
            let source = args.files.source();
            let rules = source.load().map_err(|errors| {
                anyhow::anyhow!(
                    "cannot load rules from {}:\n{errors}",
                    source.path.display()
                )
            })?;
            Ok(Start::Files { source, rules })
        }
        ConfigType::GrpcXdsSotw => {
            let settings = args.xds.settings(args.files.merge_domain_config)?;
            Ok(Start::Xds(Box::new(settings)))
        }
    }
}

/// The metrics, with the reference's stats mapped to its series, exported to statsd too
/// when asked.
async fn metrics(args: &ObservabilityArgs) -> anyhow::Result<Arc<Metrics>> {
    let mapper = args.stats_mapper()?;
    let statsd = match args.use_statsd {
        true => Some(statsd(args).await?),
        false => None,
    };
    let metrics = Arc::new(Metrics::with_mapping(
        args.near_limit_ratio,
        args.series_budget(),
        mapper,
        statsd,
    ));
    metrics.spawn_upkeep(METRICS_UPKEEP_PERIOD);
    Ok(metrics)
}

/// The statsd exporter, flushing to STATSD_HOST:STATSD_PORT in the background.
async fn statsd(args: &ObservabilityArgs) -> anyhow::Result<StatsdRecorder> {
    let target = tokio::net::lookup_host((args.statsd_host.as_str(), args.statsd_port))
        .await
        .ok()
        .and_then(|mut addrs| addrs.next())
        .with_context(|| format!("cannot resolve STATSD_HOST {}", args.statsd_host))?;
    let recorder = StatsdRecorder::default();
    tokio::spawn(recorder.clone().flush_to(target, args.stats_flush_interval));
    tracing::info!(%target, "exporting stats to statsd");
    Ok(recorder)
}

/// The rules in force, and what keeps them current: a file watcher (or poller) over the
/// loaded files, or the xDS client.
fn keep_rules_current(
    start: Start,
    args: &RuleSourceArgs,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<(Arc<ActiveRules>, Feed)> {
    match start {
        Start::Files { source, rules } => {
            RulesSeries::new(metrics.clone()).loaded(rules.version());
            tracing::info!(
                path = %source.path.display(),
                version = rules.version(),
                domains = rules.domains().count(),
                "rules loaded"
            );
            let rules = Arc::new(ActiveRules::new(rules));
            let reloader = Reloader::new(source, rules.clone(), metrics.clone());
            Ok((rules, Box::pin(reloader.watch(args.config_poll_interval))))
        }
        Start::Xds(settings) => {
            tracing::info!(server = %settings.server_url, node = %settings.node.id, "rules from xDS");
            let awaiting = format!("xds {}", settings.server_url);
            let rules = Arc::new(ActiveRules::awaiting(awaiting));
            let client = xds_client::Client::new(*settings, rules.clone(), metrics.clone())?;
            Ok((rules, Box::pin(client.run())))
        }
    }
}

/// State in this process; RLQS shares beside it.
fn memory_backend(
    args: &BackendArgs,
    stack: &StackConfig,
    metrics: &Arc<Metrics>,
) -> (MemoryStack, ShareStore) {
    let store = MemoryBackend::new(args.memory_max_keys, args.memory_max_bytes)
        .counting_evictions(metrics.memory_evictions.clone());
    store.spawn_sweeper(MEMORY_SWEEP_PERIOD);
    let shares = ShareStore::Memory(MemoryShares::new(args.memory_max_keys));
    (stack::memory(store, stack, metrics), shares)
}

/// State in Redis, connected in the background (calls fail, as a down Redis's would, until
/// it is reached); RLQS shares live in the same Redis, on the same connections.
fn redis_backend(
    args: &RedisArgs,
    stack: &StackConfig,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<(RedisStack, ShareStore)> {
    let config = args.config()?;
    tracing::info!(?config, "connecting to Redis");
    let redis = Arc::new(OnceLock::new());
    let connected = Deferred::connect({
        let (redis, metrics) = (redis.clone(), metrics.clone());
        move || {
            let (config, redis, metrics) = (config.clone(), redis.clone(), metrics.clone());
            async move {
                let backend = RedisBackend::connect(&config).await?;
                backend.watch_eviction(metrics);
                let _ = redis.set(backend.clone());
                Ok(backend)
            }
        }
    });
    Ok((
        stack::redis(connected, stack, metrics),
        ShareStore::Redis(redis),
    ))
}

fn build_service<B: Backend>(
    backend: B,
    shares: ShareStore,
    args: &ServeArgs,
    rules: Arc<ActiveRules>,
    metrics: &Arc<Metrics>,
) -> Service<B> {
    let settings = args.settings();
    let fallback = Fallback::new(
        args.failure.local_share,
        args.backend.memory_max_keys,
        args.backend.memory_max_bytes,
        args.failure.local_ledger_keys,
    )
    .counting_evictions(metrics.memory_evictions.clone())
    .counting_charges(metrics.ledger.clone());
    fallback.spawn_sweeper(MEMORY_SWEEP_PERIOD);
    let quota = Arc::new(rlqs::QuotaService::new(
        rules.clone(),
        shares,
        args.rlqs
            .settings(settings.on_backend_error, settings.bounds),
        metrics.clone(),
    ));
    let limiter = Arc::new(RateLimiter::new(
        rules.clone(),
        backend,
        fallback,
        settings,
        metrics.clone(),
    ));
    let (reporter, health_service) = tonic_health::server::health_reporter();
    let requirements = Requirements {
        backend: args.failure.on_backend_error == PolicyArg::Error,
        rules: args
            .healthy_with_at_least_one_config_loaded
            .then(|| rules.clone()),
        awaited: Some(rules.clone()),
    };
    let others =
        Routes::new(health_service).add_service(quota.server(args.limits.max_message_bytes));
    Service {
        limiter,
        rules,
        in_flight: Arc::new(Semaphore::new(args.limits.max_in_flight)),
        health: Arc::new(Health::new(reporter, requirements)),
        others,
    }
}

/// Ends at SIGTERM or SIGINT, once health reports not-serving and the ports stop accepting.
async fn wait_for_shutdown(health: &Health, stop: watch::Sender<bool>) {
    shutdown_signal().await;
    tracing::info!("shutting down: finishing in-flight calls");
    health.set_stopping().await;
    let _ = stop.send(true);
}

/// Until the servers finish their calls, or `grace` after `shutdown` ends: connections that
/// stay open past it must not hold the process. A gRPC server's failure is the error.
async fn drain(
    grpc: impl Future<Output = anyhow::Result<()>>,
    http: impl Future<Output = ()>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) -> anyhow::Result<()> {
    let deadline = async {
        shutdown.await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        (grpc, ()) = async { tokio::join!(grpc, http) } => grpc.context("gRPC server failed")?,
        () = deadline => tracing::warn!(?grace, "grace period over; closing open connections"),
    }
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; stop with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::pending;

    /// Rows: whether the servers finish, fail, or hang, and whether a shutdown came; then
    /// what `drain` gives (None: still waiting after a long while).
    #[tokio::test(start_paused = true)]
    async fn drain_waits_for_the_servers_or_the_grace_period() {
        let grace = Duration::from_secs(10);
        let never = Duration::from_secs(3_600);
        for (servers, shutdown, outcome) in [
            ("finish", false, Some(Ok(()))),
            ("fail", false, Some(Err("gRPC server failed"))),
            ("hang", true, Some(Ok(()))),
            ("hang", false, None),
        ] {
            let grpc = async move {
                match servers {
                    "finish" => Ok(()),
                    "fail" => Err(anyhow::anyhow!("a gRPC serving thread stopped")),
                    _ => pending().await,
                }
            };
            let signal = async move {
                if !shutdown {
                    pending::<()>().await;
                }
            };
            let drained = drain(grpc, async {}, signal, grace);
            let result = tokio::time::timeout(never, drained).await;
            match (result, outcome) {
                (Err(_), None) | (Ok(Ok(())), Some(Ok(()))) => {}
                (Ok(Err(e)), Some(Err(cause))) => {
                    assert!(e.to_string().contains(cause), "{servers}: {e:#}")
                }
                (result, _) => panic!("{servers}, shutdown {shutdown}: {result:?}"),
            }
        }
    }

    /// The grace period counts from the shutdown, not from the start.
    #[tokio::test(start_paused = true)]
    async fn the_grace_period_starts_at_the_shutdown() {
        let grace = Duration::from_secs(10);
        let start = tokio::time::Instant::now();
        let shutdown = tokio::time::sleep(Duration::from_secs(5));
        drain(pending(), async {}, shutdown, grace).await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_secs(15));
    }

    /// Rule files that do not load stop the start with their errors; xDS settings are
    /// checked, no file is read.
    #[test]
    fn loading_the_rules_fails_with_the_cause() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("bad.yaml");
        std::fs::write(&bad, "domain: [\n").unwrap();
        let good = dir.path().join("good.yaml");
        std::fs::write(&good, "domain: d\ndescriptors: []\n").unwrap();
        let rules = |args: &[&str]| crate::app::cli::parse_serve(args).unwrap().rules;
        let bad_path = bad.to_str().unwrap();
        let err = load_rules(&rules(&["--config", bad_path])).err();
        assert!(
            err.as_ref()
                .is_some_and(|e| e.to_string().contains(bad_path)),
            "{err:?}"
        );
        let start = load_rules(&rules(&["--config", good.to_str().unwrap()])).unwrap();
        assert!(matches!(start, Start::Files { .. }));
        let xds = ["--config", bad_path, "--config-type", "GRPC_XDS_SOTW"];
        assert!(matches!(load_rules(&rules(&xds)), Ok(Start::Xds(_))));
    }
}
