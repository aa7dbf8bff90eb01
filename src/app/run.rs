//! Start-up and shutdown: load the rules (and watch them), build the backend, serve gRPC
//! and the admin HTTP port; on SIGTERM/SIGINT report not-serving, stop accepting, and
//! finish in-flight calls. Connections are accepted by `edge::connections`, within caps that
//! fit the open-files limit.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};
use tonic::service::{RecoverErrorLayer, Routes};
use tower::limit::GlobalConcurrencyLimitLayer;

use crate::app::cli::{
    BackendKind, ChargingArg, ConfigType, HeadersArg, KeyLayoutArg, MetadataArg, PolicyArg,
    RedisType, ServeArgs,
};
use crate::backend::Backend;
use crate::backend::breaker::BreakerConfig;
use crate::backend::deferred::Deferred;
use crate::backend::memory::MemoryBackend;
use crate::backend::redis::{KeyLayout, RedisBackend, RedisConfig, RedisMode, RedisTls, Wait};
use crate::backend::stack::{self, StackConfig};
use crate::config::active::ActiveRules;
use crate::config::reload::Reloader;
use crate::config::xds_client;
use crate::decision::Charging;
use crate::decision::FailurePolicy;
use crate::edge;
use crate::edge::admin::{self, Admin, InFlight};
use crate::edge::connections::{self, Handshake, Port};
use crate::edge::grpc::{CallCaps, CallHandler, ShouldRateLimitLayer};
use crate::edge::health::{Health, Requirements};
use crate::edge::layers::GrpcMetricsLayer;
use crate::ops::mapper::Mapper;
use crate::ops::metrics::Metrics;
use crate::ops::rules_series::RulesSeries;
use crate::ops::statsd::StatsdRecorder;
use crate::rlqs::{self, MemoryShares, ShareStore};
use crate::service::fallback::Fallback;
use crate::service::request::Bounds;
use crate::service::response::{Headers, MetadataOn, ResponseSettings};
use crate::service::{RateLimiter, Settings};

/// Keys with quota leases held at once by one instance.
const MAX_LEASE_POOLS: usize = 100_000;
const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";
/// Often, so that each fold of latency samples is short: a second's samples at 60 000 calls/s
/// kept the thread folding them 0.8 ms, which a thread serving calls on its CPU waited out.
const METRICS_UPKEEP_PERIOD: Duration = Duration::from_millis(50);
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
            max_descriptor_bytes: args.max_descriptor_bytes,
        },
        charging: match args.charging {
            ChargingArg::Atomic => Charging::Atomic,
            ChargingArg::PerDescriptor => Charging::PerDescriptor,
        },
        response: ResponseSettings {
            headers,
            metadata: match args.response_metadata {
                MetadataArg::Refusals => MetadataOn::Refusals,
                MetadataArg::All => MetadataOn::All,
                MetadataArg::Off => MetadataOn::Off,
            },
            reference_metadata: args.response_dynamic_metadata,
            global_shadow: args.shadow_mode,
        },
        quota_mode: args.quota_mode,
        request_timeout: args.request_timeout,
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
        batch: args.redis_batch,
        io_slice: Some(args.redis_io_slice).filter(|slice| !slice.is_zero()),
        connect_timeout: args.redis_connect_timeout,
        call_timeout: args.redis_timeout,
        wait: (args.redis_wait_replicas > 0).then_some(Wait {
            replicas: args.redis_wait_replicas,
            timeout: args.redis_wait_timeout,
        }),
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
/// The mapping of the reference's stats: PROMETHEUS_MAPPER_YAML's, else the built-in one.
fn stats_mapper(args: &ServeArgs) -> anyhow::Result<Mapper> {
    let Some(path) = &args.prometheus_mapper_yaml else {
        return Ok(Mapper::reference_default(
            args.prometheus_response_time_as_milliseconds,
        ));
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("PROMETHEUS_MAPPER_YAML {}: {e}", path.display()))?;
    Mapper::from_yaml(&text)
        .map_err(|e| anyhow::anyhow!("PROMETHEUS_MAPPER_YAML {}: {e}", path.display()))
}

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

/// The xDS client's settings, checked before anything starts.
fn xds_settings(args: &ServeArgs) -> anyhow::Result<xds_client::Settings> {
    let x = &args.xds;
    anyhow::ensure!(
        x.xds_backoff_random_factor >= 0.0,
        "XDS_CLIENT_BACKOFF_RANDOM_FACTOR must be a number from 0 (got {})",
        x.xds_backoff_random_factor
    );
    let tls = x.xds_tls.then(|| -> anyhow::Result<_> {
        let identity = match (&x.xds_tls_cert, &x.xds_tls_key) {
            (Some(cert), Some(key)) => Some((read(cert)?, read(key)?)),
            _ => None,
        };
        let ca = x.xds_tls_cacert.as_ref().map(read).transpose()?;
        Ok(xds_client::tls(ca, identity, x.xds_tls_san.as_deref()))
    });
    Ok(xds_client::Settings {
        server_url: x.xds_server_url.clone(),
        node: xds_client::node(&x.xds_node_id, &x.xds_node_metadata),
        headers: xds_client::headers(&x.xds_headers)
            .context("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS")?,
        tls: tls.transpose()?,
        connect_retry_interval: x.xds_connect_retry_interval,
        max_message_bytes: x.xds_max_message_bytes.filter(|&n| n > 0),
        backoff: xds_client::Backoff {
            initial: x.xds_backoff_initial,
            max: x.xds_backoff_max,
            random_factor: x.xds_backoff_random_factor,
            jitter: x.xds_backoff_jitter,
        },
        merge_domains: args.rules.merge_domain_config,
    })
}

/// The rules at start-up: loaded from files, or to come from a control plane.
enum Start {
    Files(crate::config::RuleSet),
    Xds(Box<xds_client::Settings>),
}

/// Keeps the rules current: the file watcher, or the xDS client.
type Feed = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let source = args.rules.source();
    let start = match args.xds.config_type {
        ConfigType::File => {
            let rules = source.load().map_err(|errors| {
                anyhow::anyhow!(
                    "cannot load rules from {}:\n{errors}",
                    source.path.display()
                )
            })?;
            Start::Files(rules)
        }
        ConfigType::GrpcXdsSotw => Start::Xds(Box::new(xds_settings(&args)?)),
    };
    let mapper = stats_mapper(&args)?;
    let statsd = match args.use_statsd {
        true => Some(statsd(&args).await?),
        false => None,
    };
    let metrics = Arc::new(Metrics::with_mapping(
        args.near_limit_ratio,
        crate::ops::metrics::SeriesBudget {
            max_series: args.max_series,
            max_bytes: args.max_series_bytes,
        },
        mapper,
        statsd,
    ));
    metrics.spawn_upkeep(METRICS_UPKEEP_PERIOD);
    let (rules, feed): (_, Feed) = match start {
        Start::Files(rules) => {
            RulesSeries::new(metrics.clone()).loaded(rules.version());
            tracing::info!(
                path = %source.path.display(),
                version = rules.version(),
                domains = rules.domains().count(),
                "rules loaded"
            );
            let rules = Arc::new(ActiveRules::new(rules));
            let reloader = Reloader::new(source, rules.clone(), metrics.clone());
            (rules, Box::pin(reloader.watch(args.config_poll_interval)))
        }
        Start::Xds(settings) => {
            tracing::info!(server = %settings.server_url, node = %settings.node.id, "rules from xDS");
            let rules = Arc::new(ActiveRules::awaiting(format!(
                "xds {}",
                settings.server_url
            )));
            let client = xds_client::Client::new(*settings, rules.clone(), metrics.clone())?;
            (rules, Box::pin(client.run()))
        }
    };
    let backend = args.backend_kind();
    let stack = StackConfig {
        breaker: BreakerConfig {
            failures_to_open: args.breaker_failures,
            max_backoff: args.breaker_max_backoff,
            ..BreakerConfig::default()
        },
        over_limit_entries: args
            .local_cache_size_in_bytes
            .map_or(args.local_cache_entries, |bytes| bytes / 256),
        max_leases: MAX_LEASE_POOLS,
    };
    match backend {
        BackendKind::Memory => {
            let store = MemoryBackend::new(args.memory_max_keys, args.memory_max_bytes)
                .counting_evictions(metrics.memory_evictions.clone());
            store.spawn_sweeper(MEMORY_SWEEP_PERIOD);
            let backend = stack::memory(store, &stack, &metrics);
            let shares = ShareStore::Memory(MemoryShares::new(args.memory_max_keys));
            run(backend, shares, &args, rules, feed, metrics).await
        }
        BackendKind::Redis => {
            let config = redis_config(&args)?;
            tracing::info!(?config, "connecting to Redis");
            // RLQS shares live in the same Redis, on the same connections.
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
            let backend = stack::redis(connected, &stack, &metrics);
            let shares = ShareStore::Redis(redis);
            run(backend, shares, &args, rules, feed, metrics).await
        }
    }
}

async fn run<B: Backend>(
    backend: B,
    shares: ShareStore,
    args: &ServeArgs,
    rules: Arc<ActiveRules>,
    feed: Feed,
    metrics: Arc<Metrics>,
) -> anyhow::Result<()> {
    let watcher = tokio::spawn(feed);
    let fallback = Fallback::new(
        args.local_share,
        args.memory_max_keys,
        args.memory_max_bytes,
        args.local_ledger_keys,
    )
    .counting_evictions(metrics.memory_evictions.clone())
    .counting_charges(metrics.ledger.clone());
    fallback.spawn_sweeper(MEMORY_SWEEP_PERIOD);
    let quota = rlqs::QuotaService::new(
        rules.clone(),
        shares,
        rlqs::Settings {
            ttl: args.rlqs_ttl,
            on_backend_error: settings(args).on_backend_error,
            bounds: settings(args).bounds,
            max_bytes: args.rlqs_max_bytes,
            max_buffer_bytes: args.rlqs_max_buffer_bytes,
            max_streams: args.rlqs_max_streams,
            max_streams_per_peer: args.rlqs_max_streams_per_peer,
        },
        metrics.clone(),
    );
    let limiter = Arc::new(RateLimiter::new(
        rules.clone(),
        backend,
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
        awaited: Some(rules.clone()),
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
    let grpc_listener = connections::bind(grpc_addr)
        .with_context(|| format!("cannot listen for gRPC on {grpc_addr}"))?;
    let http_listener = TcpListener::bind(http_addr)
        .await
        .with_context(|| format!("cannot listen for HTTP on {http_addr}"))?;
    tracing::info!(%grpc_addr, %http_addr, "listening");
    // One cap on calls in flight for all serving threads: `ShouldRateLimit` takes its place
    // once its message is here (`grpc`), the other methods as they start.
    let in_flight = Arc::new(Semaphore::new(args.max_in_flight));
    let admin = Arc::new(Admin {
        limiter: limiter.clone(),
        rules,
        health: health.clone(),
        metrics: metrics.clone(),
        in_flight: InFlight::new(in_flight.clone(), args.max_in_flight, &metrics),
    });
    // The main admin port, then the reference's optional ones: debug (/rlconfig) and a
    // Prometheus port of its own.
    let mut routers = vec![("http", http_listener, admin::router(admin.clone()))];
    if let Some(addr) = args.debug_addr() {
        match TcpListener::bind(addr).await {
            Ok(listener) => routers.push(("debug", listener, admin::debug_router(admin.clone()))),
            Err(error) => tracing::warn!(%addr, %error, "debug port not opened"),
        }
    }
    if args.use_prometheus {
        let addr = args.prometheus_addr()?;
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen for Prometheus on {addr}"))?;
        routers.push((
            "prometheus",
            listener,
            admin::metrics_router(admin, &args.prometheus_path),
        ));
    }
    let open_files = connections::open_files_limit();
    let (grpc_cap, http_cap) = connections::fit_caps(
        open_files,
        args.grpc_max_connections,
        args.http_max_connections,
        routers.len(),
    );
    if (grpc_cap, http_cap) != (args.grpc_max_connections, args.http_max_connections) {
        tracing::warn!(
            ?open_files,
            grpc_cap,
            http_cap,
            "connection caps lowered to fit the open-files limit"
        );
    }
    let grpc_per_peer = connections::peer_share(grpc_cap, args.grpc_max_connections_per_peer);
    if grpc_per_peer != args.grpc_max_connections_per_peer {
        tracing::warn!(
            grpc_cap,
            grpc_per_peer,
            "a peer's share of gRPC connections lowered to half the port's cap"
        );
    }

    let (stop, stopped) = watch::channel(false);
    let threads = args.grpc_threads();
    let handoffs = connections::spread(
        grpc_listener,
        Port {
            max_connections: grpc_cap,
            max_per_peer: grpc_per_peer,
            make_room: true,
            handshake: Handshake::Http2 {
                tls: tls_acceptor(args)?,
                timeout: args.grpc_handshake_timeout,
            },
            // A peer that stops reading stops answering pings too: keepalive closes it.
            write_stall: None,
            metrics: metrics.connections("grpc"),
        },
        threads,
    );
    tracing::info!(threads, "serving gRPC");
    // Two per serving thread: one deciding while the other waits for its backend.
    let costly = Arc::new(Semaphore::new(2 * threads));
    let quota = Arc::new(quota);
    let mut servers = Vec::with_capacity(threads);
    let http2 = edge::http::Http2 {
        keepalive_interval: args.grpc_keepalive_interval,
        keepalive_timeout: args.grpc_keepalive_timeout,
        max_streams: args.grpc_max_streams,
    };
    let max_age = edge::http::MaxAge {
        age: args.grpc_max_connection_age,
        grace: args.grpc_max_connection_age_grace,
    };
    // What `ShouldRateLimit` is answered with, on every connection of every serving thread.
    let edge = Arc::new(CallHandler::new(
        limiter.clone(),
        args.max_message_bytes,
        CallCaps {
            in_flight: in_flight.clone(),
            per_peer: args.max_in_flight_per_peer,
            costly,
        },
    ));
    for (n, handoff) in handoffs.into_iter().enumerate() {
        // A call's way in, outermost first: its metrics; `ShouldRateLimit` answered by the
        // edge; any other method (health, RLQS) within the cap on calls in flight, refused
        // at once past it, its errors answered as gRPC statuses. The first two are made for
        // each connection, which tells the edge who its calls come from.
        let inner = tower::ServiceBuilder::new()
            .map_response(|response: http::Response<_>| response.map(tonic::body::Body::new))
            .layer(RecoverErrorLayer::new())
            .load_shed()
            .layer(GlobalConcurrencyLimitLayer::with_semaphore(
                in_flight.clone(),
            ))
            .service(
                Routes::new(health_service.clone())
                    .add_service(quota.server(args.max_message_bytes))
                    .prepare(),
            );
        let (metrics, edge) = (metrics.clone(), Arc::clone(&edge));
        let stack = move |caller| {
            tower::ServiceBuilder::new()
                .layer(GrpcMetricsLayer::new(metrics.clone()))
                .layer(ShouldRateLimitLayer::new(Arc::clone(&edge), caller))
                .service(inner.clone())
        };
        let stopped = stopped.clone();
        let (done, served) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name(format!("turnstile-grpc-{n}"))
            .spawn(move || {
                let result = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map(|runtime| {
                        // The handoff registers sockets with the runtime it is taken on.
                        runtime.block_on(async move {
                            tokio::spawn(crate::app::allocator::give_back());
                            edge::http::connections(
                                handoff.serve_here(),
                                stopped,
                                Some(max_age),
                                |conn| {
                                    let caller = conn.caller();
                                    http2.connection(conn, stack(caller))
                                },
                            )
                            .await;
                        });
                    })
                    .map_err(anyhow::Error::from);
                let _ = done.send(result);
            })
            .context("cannot start a gRPC serving thread")?;
        servers.push(served);
    }
    let grpc = async move {
        for served in servers {
            served
                .await
                .unwrap_or_else(|_| Err(anyhow::anyhow!("a gRPC serving thread stopped")))?;
        }
        anyhow::Ok(())
    };
    let http = futures_util::future::join_all(routers.into_iter().map(|(name, tcp, router)| {
        let port = Port {
            max_connections: http_cap,
            max_per_peer: http_cap,
            make_room: false,
            handshake: Handshake::Http1,
            write_stall: Some(args.http_read_timeout),
            metrics: metrics.connections(name),
        };
        admin::serve(
            connections::incoming(tcp, port),
            router,
            args.http_read_timeout,
            stopped.clone(),
        )
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
        (grpc, _) = async { tokio::join!(grpc, http) } => grpc.context("gRPC server failed")?,
        () = deadline => tracing::warn!(grace = ?args.shutdown_grace, "grace period over; closing open connections"),
    }
    probe.abort();
    watcher.abort();
    tracing::info!("stopped");
    Ok(())
}

/// gRPC TLS from the certificate files, with client verification when a CA is given; HTTP/2
/// only, as gRPC.
fn tls_acceptor(args: &ServeArgs) -> anyhow::Result<Option<TlsAcceptor>> {
    let (Some(cert), Some(key)) = (&args.grpc_tls_cert, &args.grpc_tls_key) else {
        if args.grpc_tls {
            anyhow::bail!("GRPC_SERVER_USE_TLS needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY");
        }
        return Ok(None);
    };
    let chain = CertificateDer::pem_slice_iter(&read(cert)?)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("no PEM certificate in {}", cert.display()))?;
    let key = PrivateKeyDer::from_pem_slice(&read(key)?)
        .with_context(|| format!("no PEM private key in {}", key.display()))?;
    let config = ServerConfig::builder();
    let config = match &args.grpc_client_ca {
        None => config.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(&read(ca)?) {
                roots
                    .add(cert.with_context(|| format!("bad PEM in {}", ca.display()))?)
                    .with_context(|| format!("bad CA certificate in {}", ca.display()))?;
            }
            config.with_client_cert_verifier(
                WebPkiClientVerifier::builder(roots.into())
                    .build()
                    .context("client CA")?,
            )
        }
    };
    let mut config = config
        .with_single_cert(chain, key)
        .context("gRPC TLS certificate and key")?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Some(TlsAcceptor::from(Arc::new(config))))
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
