//! Start-up and shutdown: load the rules (and watch them), build the backend, serve gRPC
//! and the admin HTTP port; on SIGTERM/SIGINT report not-serving, stop accepting, and
//! finish in-flight calls.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::active::ActiveRules;
use crate::admin::{self, Admin};
use crate::backend::breaker::{Breaker, BreakerConfig};
use crate::backend::deferred::Deferred;
use crate::backend::leased::Leased;
use crate::backend::measured::Measured;
use crate::backend::memory::MemoryBackend;
use crate::backend::overlimit_cache::OverLimitCache;
use crate::backend::redis::{KeyLayout, RedisBackend, RedisConfig, RedisMode, RedisTls};
use crate::backend::{Backend, Charging};
use crate::cli::{
    BackendKind, ChargingArg, HeadersArg, KeyLayoutArg, PolicyArg, RedisType, ServeArgs,
};
use crate::config::RuleSet;
use crate::fallback::{FailurePolicy, Fallback};
use crate::health::{Health, Requirements};
use crate::layers::GrpcMetricsLayer;
use crate::metrics::Metrics;
use crate::reload::Reloader;
use crate::request::Bounds;
use crate::response::{Headers, ResponseSettings};
use crate::rlqs::{self, MemoryShares, ShareStore};
use crate::service::{RateLimiter, Settings};
use crate::statsd::StatsdRecorder;

/// Keys with quota leases held at once by one instance.
const MAX_LEASE_POOLS: usize = 100_000;
const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
const METRICS_UPKEEP_PERIOD: Duration = Duration::from_secs(1);
const BACKEND_PROBE_PERIOD: Duration = Duration::from_secs(1);
const MEMORY_SWEEP_PERIOD: Duration = Duration::from_secs(1);

fn settings(args: &ServeArgs) -> Settings {
    let headers = match (args.response_headers, args.limit_response_headers_enabled) {
        (HeadersArg::Ietf, _) => Headers::Ietf,
        (HeadersArg::Legacy, _) | (HeadersArg::Off, true) => Headers::Legacy {
            limit: args.limit_limit_header.clone(),
            remaining: args.limit_remaining_header.clone(),
            reset: args.limit_reset_header.clone(),
        },
        (HeadersArg::Off, false) => Headers::Off,
    };
    Settings {
        bounds: Bounds {
            max_descriptors: args.max_descriptors,
            max_entries: args.max_entries,
            max_bytes: args.max_bytes,
        },
        charging: match args.charging {
            ChargingArg::Atomic => Charging::Atomic,
            ChargingArg::PerDescriptor => Charging::PerDescriptor,
        },
        response: ResponseSettings {
            headers,
            metadata: args.response_metadata,
            reference_metadata: args.response_dynamic_metadata,
            global_shadow: args.shadow_mode,
        },
        quota_mode: args.quota_mode,
        on_backend_error: match args.on_backend_error {
            PolicyArg::Error => FailurePolicy::Error,
            PolicyArg::Allow => FailurePolicy::Allow,
            PolicyArg::Deny => FailurePolicy::Deny,
            PolicyArg::Local => FailurePolicy::Local,
        },
    }
}

/// The Redis settings; `REDIS_URL` is read as the reference reads it: one address, a
/// comma-separated list of Cluster seeds, or for Sentinel the master's name followed by the
/// Sentinels' addresses.
fn redis_config(args: &ServeArgs) -> anyhow::Result<RedisConfig> {
    let mut urls: Vec<String> = args
        .redis_url
        .as_deref()
        .unwrap_or(DEFAULT_REDIS_URL)
        .split(',')
        .map(|u| u.trim().to_owned())
        .filter(|u| !u.is_empty())
        .collect();
    let mode = match args.redis_type {
        RedisType::Single => RedisMode::Single,
        RedisType::Cluster => RedisMode::Cluster,
        RedisType::Sentinel => {
            if urls.len() < 2 {
                anyhow::bail!(
                    "REDIS_TYPE=sentinel needs REDIS_URL as 'master-name,sentinel:port,...'"
                );
            }
            RedisMode::Sentinel {
                master: urls.remove(0),
            }
        }
    };
    Ok(RedisConfig {
        urls,
        mode,
        connections: args.redis_connections,
        connect_timeout: args.redis_connect_timeout,
        call_timeout: args.redis_timeout,
        key_prefix: args.cache_key_prefix.clone(),
        key_layout: match args.key_layout {
            KeyLayoutArg::Turnstile => KeyLayout::Turnstile,
            KeyLayoutArg::Reference => KeyLayout::Reference,
        },
        auth: args.redis_auth.clone().filter(|a| !a.is_empty()),
        tls_by_default: args.redis_tls,
        tls: RedisTls {
            ca: args.redis_tls_cacert.as_ref().map(read).transpose()?,
            client: match (&args.redis_tls_client_cert, &args.redis_tls_client_key) {
                (Some(cert), Some(key)) => Some((read(cert)?, read(key)?)),
                _ => None,
            },
        },
    })
}

fn read(path: &std::path::PathBuf) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
}

/// The statsd exporter, flushing to STATSD_HOST:STATSD_PORT in the background.
async fn statsd(args: &ServeArgs) -> anyhow::Result<StatsdRecorder> {
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

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let source = args.rules.source();
    let rules = source.load().map_err(|errors| {
        anyhow::anyhow!(
            "cannot load rules from {}:\n{errors}",
            source.path.display()
        )
    })?;
    let statsd = match args.use_statsd {
        true => Some(statsd(&args).await?),
        false => None,
    };
    let metrics = Arc::new(Metrics::with_statsd(
        args.near_limit_ratio,
        args.max_series,
        statsd,
    ));
    metrics.spawn_upkeep(METRICS_UPKEEP_PERIOD);
    metrics.config_load_success.increment(1);
    tracing::info!(
        path = %source.path.display(),
        version = rules.version(),
        domains = rules.domains().count(),
        "rules loaded"
    );
    // The reference's default backend is Redis: a deployment that names a Redis and no
    // backend keeps using Redis.
    let backend = args.backend.unwrap_or(if args.redis_url.is_some() {
        BackendKind::Redis
    } else {
        BackendKind::Memory
    });
    match backend {
        BackendKind::Memory => {
            let backend = MemoryBackend::new(args.memory_max_keys);
            backend.spawn_sweeper(MEMORY_SWEEP_PERIOD);
            let backend = Measured::new(backend, metrics.clone());
            let shares = ShareStore::Memory(MemoryShares::new(args.memory_max_keys));
            run(backend, shares, &args, rules, metrics).await
        }
        BackendKind::Redis => {
            let config = redis_config(&args)?;
            tracing::info!(?config, "connecting to Redis");
            // RLQS shares live in the same Redis, on the same connections.
            let redis = Arc::new(OnceLock::new());
            let connected = Deferred::connect({
                let redis = redis.clone();
                move || {
                    let (config, redis) = (config.clone(), redis.clone());
                    async move {
                        let backend = RedisBackend::connect(&config).await?;
                        let _ = redis.set(backend.clone());
                        Ok(backend)
                    }
                }
            });
            let entries = args
                .local_cache_size_in_bytes
                .map_or(args.local_cache_entries, |bytes| bytes / 256);
            let measured = Measured::new(connected, metrics.clone());
            let cached = OverLimitCache::new(measured, entries, metrics.clone());
            let backend = Leased::new(cached, MAX_LEASE_POOLS);
            run(backend, ShareStore::Redis(redis), &args, rules, metrics).await
        }
    }
}

async fn run<B: Backend>(
    backend: B,
    shares: ShareStore,
    args: &ServeArgs,
    rules: RuleSet,
    metrics: Arc<Metrics>,
) -> anyhow::Result<()> {
    let rules = Arc::new(ActiveRules::new(rules));
    let reloader = Reloader::new(args.rules.source(), rules.clone(), metrics.clone());
    let watcher = tokio::spawn(reloader.watch(args.config_poll_interval));
    let fallback = Fallback::new(args.local_share, args.memory_max_keys);
    fallback.spawn_sweeper(MEMORY_SWEEP_PERIOD);
    let breaker = BreakerConfig {
        failures_to_open: args.breaker_failures,
        max_backoff: args.breaker_max_backoff,
        ..BreakerConfig::default()
    };
    let quota = rlqs::QuotaService::new(
        rules.clone(),
        shares,
        rlqs::Settings {
            ttl: args.rlqs_ttl,
            on_backend_error: settings(args).on_backend_error,
            bounds: settings(args).bounds,
        },
        metrics.clone(),
    );
    let limiter = Arc::new(RateLimiter::new(
        rules.clone(),
        Breaker::new(backend, breaker, metrics.clone()),
        fallback,
        settings(args),
        metrics.clone(),
    ));
    let (reporter, health_service) = tonic_health::server::health_reporter();
    let requirements = Requirements {
        backend: args.on_backend_error == PolicyArg::Error,
        rules: args
            .healthy_with_at_least_one_config_loaded
            .then(|| rules.clone()),
    };
    let health = Arc::new(Health::new(reporter, requirements));
    let probe = tokio::spawn({
        let (health, limiter) = (health.clone(), limiter.clone());
        async move {
            health
                .watch_backend(limiter.backend(), BACKEND_PROBE_PERIOD)
                .await
        }
    });

    let grpc_addr = args.grpc_addr();
    let http_addr = args.http_addr();
    let grpc_listener = TcpListener::bind(grpc_addr)
        .await
        .with_context(|| format!("cannot listen for gRPC on {grpc_addr}"))?;
    let http_listener = TcpListener::bind(http_addr)
        .await
        .with_context(|| format!("cannot listen for HTTP on {http_addr}"))?;
    tracing::info!(%grpc_addr, %http_addr, "listening");

    let tls = tls_config(args)?;
    let (stop, stopped) = watch::channel(false);
    let until_stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls).context("gRPC TLS")?;
    }
    let grpc = builder
        .timeout(args.request_timeout)
        .layer(
            tower::ServiceBuilder::new()
                .layer(GrpcMetricsLayer::new(metrics.clone()))
                .load_shed()
                .concurrency_limit(args.max_in_flight),
        )
        .add_service(health_service)
        .add_service(
            RateLimitServiceServer::from_arc(limiter.clone())
                .max_decoding_message_size(args.max_message_bytes),
        )
        .add_service(
            RateLimitQuotaServiceServer::new(quota)
                .max_decoding_message_size(args.max_message_bytes),
        )
        .serve_with_incoming_shutdown(
            TcpIncoming::from(grpc_listener).with_nodelay(Some(true)),
            until_stopped(stopped.clone()),
        );
    let admin = Arc::new(Admin {
        limiter,
        rules,
        health: health.clone(),
        metrics,
    });
    // The main admin port, then the reference's optional ones: debug (/rlconfig) and a
    // Prometheus port of its own.
    let mut routers = vec![(http_listener, admin::router(admin.clone()))];
    if let Some(addr) = args.debug_addr() {
        match TcpListener::bind(addr).await {
            Ok(listener) => routers.push((listener, admin::debug_router(admin.clone()))),
            Err(error) => tracing::warn!(%addr, %error, "debug port not opened"),
        }
    }
    if args.use_prometheus {
        let addr = args.prometheus_addr()?;
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen for Prometheus on {addr}"))?;
        routers.push((
            listener,
            admin::metrics_router(admin, &args.prometheus_path),
        ));
    }
    let http = futures_util::future::try_join_all(routers.into_iter().map(|(listener, router)| {
        axum::serve(listener, router)
            .with_graceful_shutdown(until_stopped(stopped.clone()))
            .into_future()
    }));

    let signals = async {
        shutdown_signal().await;
        tracing::info!("shutting down: finishing in-flight calls");
        health.set_stopping().await;
        let _ = stop.send(true);
    };
    // Connections that stay open past the grace period must not hold the process.
    let deadline = async {
        signals.await;
        tokio::time::sleep(args.shutdown_grace).await;
    };
    tokio::select! {
        (grpc, http) = async { tokio::join!(grpc, http) } => {
            grpc.context("gRPC server failed")?;
            http.context("HTTP server failed")?;
        }
        () = deadline => tracing::warn!(grace = ?args.shutdown_grace, "grace period over; closing open connections"),
    }
    probe.abort();
    watcher.abort();
    tracing::info!("stopped");
    Ok(())
}

/// gRPC TLS from the certificate files, with client verification when a CA is given.
fn tls_config(args: &ServeArgs) -> anyhow::Result<Option<ServerTlsConfig>> {
    let (Some(cert), Some(key)) = (&args.grpc_tls_cert, &args.grpc_tls_key) else {
        if args.grpc_tls {
            anyhow::bail!("GRPC_SERVER_USE_TLS needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY");
        }
        return Ok(None);
    };
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(read(cert)?, read(key)?));
    if let Some(ca) = &args.grpc_client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read(ca)?));
    }
    Ok(Some(tls))
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
