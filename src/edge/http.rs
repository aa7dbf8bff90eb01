//! Serving a port's connections with hyper: each accepted connection (`connections`) on a
//! task of its own until the port stops, then a graceful shutdown (GOAWAY on HTTP/2,
//! `Connection: close` on HTTP/1); a gRPC connection also at its maximum age, as the
//! reference's (`GRPC_MAX_CONNECTION_AGE`).
//!
//! The gRPC port is served here, not by `tonic::transport::Server`, whose per-call layers
//! (a boxed service clone, a tracing span, a second `grpc-timeout` timer, a `date` header)
//! this service does without (measured in BENCHMARKS.md); what it needs of them (keepalive,
//! a stream cap, the caller's details, errors as gRPC statuses) is here and in `app::run`.

use std::pin::pin;
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulConnection;
use hyper_util::service::TowerToHyperService;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tower::{BoxError, Service};

use crate::edge::connections::{Conn, Incoming as Connections};

/// How long a connection may stay open: past `age` (give or take a tenth, drawn for each
/// connection) it is asked to close, and past `grace` more it is closed.
#[derive(Clone, Copy)]
pub struct MaxAge {
    pub age: Duration,
    pub grace: Duration,
}

impl MaxAge {
    /// This connection's age: `age` ± 10 %, so that connections opened together (all of an
    /// Envoy's, at its start) do not all reconnect at once.
    fn drawn(&self) -> Duration {
        self.age.mul_f64(fastrand::f64().mul_add(0.2, 0.9))
    }
}

/// Serve the connections of `incoming`, each as `connect` makes it (and for at most
/// `max_age`), until `stop` turns true; then stop accepting, shut every connection down
/// gracefully and return once all are closed.
pub async fn connections<C>(
    mut incoming: Connections,
    stop: watch::Receiver<bool>,
    max_age: Option<MaxAge>,
    mut connect: impl FnMut(Conn) -> C,
) where
    C: GracefulConnection + Send + 'static,
    C::Error: std::fmt::Display + Send,
{
    let mut open = JoinSet::new();
    let mut until = stop.clone();
    loop {
        let conn = tokio::select! {
            () = stopped(&mut until) => break,
            Some(_) = open.join_next(), if !open.is_empty() => continue,
            conn = incoming.next() => conn,
        };
        let Some(conn) = conn else { break };
        open.spawn(serve(connect(conn), stop.clone(), max_age));
    }
    // Closes the listener once every server dropped its stream.
    drop(incoming);
    while open.join_next().await.is_some() {}
}

/// One connection, until it ends, or is shut down gracefully once `stop` turns true or it
/// has reached its age (then closed when its grace is over).
async fn serve<C>(connection: C, mut stop: watch::Receiver<bool>, max_age: Option<MaxAge>)
where
    C: GracefulConnection,
    C::Error: std::fmt::Display,
{
    let mut connection = pin!(connection);
    // Its grace, once it is old.
    let aged = async {
        match max_age {
            Some(max_age) => {
                tokio::time::sleep(max_age.drawn()).await;
                max_age.grace
            }
            None => std::future::pending().await,
        }
    };
    let ended = tokio::select! {
        ended = connection.as_mut() => ended,
        () = stopped(&mut stop) => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
        grace = aged => {
            connection.as_mut().graceful_shutdown();
            match tokio::time::timeout(grace, connection).await {
                Ok(ended) => ended,
                Err(_) => {
                    tracing::debug!("connection closed: its age's grace is over");
                    return;
                }
            }
        }
    };
    if let Err(error) = ended {
        tracing::debug!(%error, "connection ended");
    }
}

/// Once `stop` turns true (or its sender is gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|stop| *stop).await;
}

/// How the gRPC port serves HTTP/2.
#[derive(Clone, Copy)]
pub struct Http2 {
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    pub max_streams: u32,
}

impl Http2 {
    /// The connection `conn`, serving its calls with `stack` (cloned for each call).
    pub fn connection<S, B>(
        &self,
        conn: Conn,
        stack: S,
    ) -> hyper::server::conn::http2::Connection<TokioIo<Conn>, TowerToHyperService<S>, TokioExecutor>
    where
        S: Service<http::Request<Incoming>, Response = http::Response<B>> + Clone + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Into<BoxError>,
        B: http_body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
    {
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(self.keepalive_interval)
            .keep_alive_timeout(self.keepalive_timeout)
            .max_concurrent_streams(self.max_streams)
            // A gRPC client reads no date; HTTP/2 would check and encode one on every answer.
            .auto_date_header(false)
            .serve_connection(TokioIo::new(conn), TowerToHyperService::new(stack))
    }
}
