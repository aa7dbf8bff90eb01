//! The ports: listening on gRPC and the admin HTTP ports, serving gRPC on threads of its
//! own (each with its runtime and the connections handed to it) and the admin ports on the
//! main runtime, until `stopped`.

use std::future::Future;
use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, oneshot, watch};
use tonic::service::{RecoverErrorLayer, Routes};
use tower::limit::GlobalConcurrencyLimitLayer;

use crate::app::cli::ServeArgs;
use crate::backend::Backend;
use crate::config::active::ActiveRules;
use crate::edge;
use crate::edge::admin::{self, Admin, InFlight};
use crate::edge::connections::{self, Handoff, Handshake, Port};
use crate::edge::grpc::{CallCaps, CallHandler, ShouldRateLimitLayer};
use crate::edge::health::Health;
use crate::edge::layers::GrpcMetricsLayer;
use crate::ops::metrics::Metrics;
use crate::service::RateLimiter;

/// What every port serves: the limiter, RLQS and health.
pub(super) struct Service<B> {
    pub(super) limiter: Arc<RateLimiter<B>>,
    pub(super) rules: Arc<ActiveRules>,
    pub(super) health: Arc<Health>,
    /// One cap on calls in flight for all serving threads: `ShouldRateLimit` takes its place
    /// once its message is here (`grpc`), the other methods as they start.
    pub(super) in_flight: Arc<Semaphore>,
    /// The gRPC methods other than `ShouldRateLimit`: health and RLQS.
    pub(super) others: Routes,
}

/// The listening ports, and their caps on open connections.
pub(super) struct Ports {
    pub(super) grpc: TcpListener,
    /// The admin ports by name, with their routes.
    pub(super) http: Vec<(&'static str, TcpListener, Router)>,
    pub(super) caps: Caps,
}

/// Caps on open connections, fitted to the open-files limit.
#[derive(Clone, Copy)]
pub(super) struct Caps {
    grpc: usize,
    /// Of the gRPC port's, the most one peer may hold.
    grpc_per_peer: usize,
    /// Each admin port's.
    http: usize,
}

/// Listen on gRPC and the main admin port (either failing stops the start), then the
/// reference's optional ones: debug (/rlconfig, skipped if taken) and Prometheus.
pub(super) async fn bind_ports<B: Backend>(
    args: &ServeArgs,
    service: &Service<B>,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<Ports> {
    let (grpc_addr, http_addr) = (args.grpc.addr(), args.http.addr());
    let grpc = connections::bind(grpc_addr)
        .with_context(|| format!("cannot listen for gRPC on {grpc_addr}"))?;
    let http = TcpListener::bind(http_addr)
        .await
        .with_context(|| format!("cannot listen for HTTP on {http_addr}"))?;
    tracing::info!(%grpc_addr, %http_addr, "listening");
    let admin = Arc::new(Admin {
        limiter: service.limiter.clone(),
        rules: service.rules.clone(),
        health: service.health.clone(),
        metrics: metrics.clone(),
        in_flight: InFlight::new(
            service.in_flight.clone(),
            args.limits.max_in_flight,
            metrics,
        ),
    });
    let mut routers = vec![("http", http, admin::router(admin.clone()))];
    if let Some(addr) = args.http.debug_addr() {
        match TcpListener::bind(addr).await {
            Ok(listener) => routers.push(("debug", listener, admin::debug_router(admin.clone()))),
            Err(error) => tracing::warn!(%addr, %error, "debug port not opened"),
        }
    }
    let observability = &args.observability;
    if observability.use_prometheus {
        let addr = observability.prometheus_addr()?;
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen for Prometheus on {addr}"))?;
        let router = admin::metrics_router(admin, &observability.prometheus_path);
        routers.push(("prometheus", listener, router));
    }
    let caps = connection_caps(args, routers.len());
    Ok(Ports {
        grpc,
        http: routers,
        caps,
    })
}

/// The caps asked for, lowered (with a warning) to fit the open-files limit; a peer's share
/// of the gRPC port's at most half of it.
fn connection_caps(args: &ServeArgs, http_ports: usize) -> Caps {
    let asked = (
        args.grpc.grpc_max_connections,
        args.http.http_max_connections,
    );
    let open_files = connections::open_files_limit();
    let (grpc_cap, http_cap) = connections::fit_caps(open_files, asked.0, asked.1, http_ports);
    if (grpc_cap, http_cap) != asked {
        tracing::warn!(
            ?open_files,
            grpc_cap,
            http_cap,
            "connection caps lowered to fit the open-files limit"
        );
    }
    let asked_per_peer = args.grpc.grpc_max_connections_per_peer;
    let grpc_per_peer = connections::peer_share(grpc_cap, asked_per_peer);
    if grpc_per_peer != asked_per_peer {
        tracing::warn!(
            grpc_cap,
            grpc_per_peer,
            "a peer's share of gRPC connections lowered to half the port's cap"
        );
    }
    Caps {
        grpc: grpc_cap,
        grpc_per_peer,
        http: http_cap,
    }
}

/// A future that ends when the thread serving gRPC does (with its error).
type Served = oneshot::Receiver<anyhow::Result<()>>;

/// Spread gRPC connections over the serving threads, each a runtime of its own, and serve
/// them until `stopped`; the future ends when every thread has finished.
pub(super) fn serve_grpc<B: Backend>(
    listener: TcpListener,
    caps: Caps,
    args: &ServeArgs,
    service: &Service<B>,
    metrics: &Arc<Metrics>,
    stopped: &watch::Receiver<bool>,
) -> anyhow::Result<impl Future<Output = anyhow::Result<()>> + use<B>> {
    let grpc = &args.grpc;
    let threads = args.grpc_threads();
    let port = Port {
        max_connections: caps.grpc,
        max_per_peer: caps.grpc_per_peer,
        make_room: true,
        handshake: Handshake::Http2 {
            tls: grpc.tls_acceptor()?,
            timeout: grpc.grpc_handshake_timeout,
        },
        // A peer that stops reading stops answering pings too: keepalive closes it.
        write_stall: None,
        metrics: metrics.connections("grpc"),
    };
    let handoffs = connections::spread(listener, port, threads);
    tracing::info!(threads, "serving gRPC");
    let in_flight = &service.in_flight;
    // What `ShouldRateLimit` is answered with, on every connection of every serving thread.
    let edge = Arc::new(CallHandler::new(
        service.limiter.clone(),
        args.limits.max_message_bytes,
        CallCaps {
            in_flight: in_flight.clone(),
            per_peer: args.limits.max_in_flight_per_peer,
            // Two per serving thread: one deciding while the other waits for its backend.
            costly: Arc::new(Semaphore::new(2 * threads)),
        },
    ));
    let mut servers = Vec::with_capacity(threads);
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
            .service(service.others.clone().prepare());
        let (metrics, edge) = (metrics.clone(), Arc::clone(&edge));
        let stack = move |caller| {
            tower::ServiceBuilder::new()
                .layer(GrpcMetricsLayer::new(metrics.clone()))
                .layer(ShouldRateLimitLayer::new(Arc::clone(&edge), caller))
                .service(inner.clone())
        };
        let (http2, max_age) = (grpc.http2(), grpc.max_age());
        let serve = move |handoff: Handoff, stopped| {
            edge::http::connections(handoff.serve_here(), stopped, Some(max_age), move |conn| {
                let caller = conn.caller();
                http2.connection(conn, stack(caller))
            })
        };
        servers.push(spawn_serving_thread(n, handoff, stopped.clone(), serve)?);
    }
    Ok(async move {
        for served in servers {
            served
                .await
                .unwrap_or_else(|_| Err(anyhow::anyhow!("a gRPC serving thread stopped")))?;
        }
        anyhow::Ok(())
    })
}

/// A thread with a runtime of its own, serving the connections handed to it.
fn spawn_serving_thread<F>(
    n: usize,
    handoff: Handoff,
    stopped: watch::Receiver<bool>,
    serve: impl FnOnce(Handoff, watch::Receiver<bool>) -> F + Send + 'static,
) -> anyhow::Result<Served>
where
    F: Future<Output = ()>,
{
    let (done, served) = oneshot::channel();
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
                        serve(handoff, stopped).await;
                    });
                })
                .map_err(anyhow::Error::from);
            let _ = done.send(result);
        })
        .context("cannot start a gRPC serving thread")?;
    Ok(served)
}

/// Serve every admin port until `stopped`.
pub(super) fn serve_http(
    routers: Vec<(&'static str, TcpListener, Router)>,
    caps: Caps,
    args: &ServeArgs,
    metrics: &Arc<Metrics>,
    stopped: &watch::Receiver<bool>,
) -> impl Future<Output = ()> + use<> {
    let read_timeout = args.http.http_read_timeout;
    let ports = routers.into_iter().map(|(name, tcp, router)| {
        let port = Port {
            max_connections: caps.http,
            max_per_peer: caps.http,
            make_room: false,
            handshake: Handshake::Http1,
            write_stall: Some(read_timeout),
            metrics: metrics.connections(name),
        };
        let incoming = connections::incoming(tcp, port);
        admin::serve(incoming, router, read_timeout, stopped.clone())
    });
    let all = futures_util::future::join_all(ports);
    async move {
        all.await;
    }
}
