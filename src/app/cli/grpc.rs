//! The gRPC port: where it listens, its TLS, its serving threads, and its connections'
//! caps and timers.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};

use super::{BackendKind, duration, positive_duration, read};
use crate::edge::http::{Http2, MaxAge};

#[derive(Debug, Args)]
#[command(next_help_heading = "gRPC port")]
pub struct GrpcArgs {
    /// gRPC listen host.
    #[arg(long, env = "GRPC_HOST", default_value = "0.0.0.0")]
    pub grpc_host: IpAddr,
    /// gRPC listen port.
    #[arg(long, env = "GRPC_PORT", default_value_t = 8081)]
    pub grpc_port: u16,
    /// gRPC listen address; overrides --grpc-host and --grpc-port.
    #[arg(long, env = "TURNSTILE_GRPC_ADDR")]
    pub grpc_addr: Option<SocketAddr>,

    /// Serve gRPC over TLS (with --grpc-tls-cert and --grpc-tls-key).
    #[arg(long, env = "GRPC_SERVER_USE_TLS")]
    pub grpc_tls: bool,
    /// PEM certificate chain for gRPC TLS.
    #[arg(long, env = "GRPC_SERVER_TLS_CERT", requires = "grpc_tls_key")]
    pub grpc_tls_cert: Option<PathBuf>,
    /// PEM private key for gRPC TLS.
    #[arg(long, env = "GRPC_SERVER_TLS_KEY", requires = "grpc_tls_cert")]
    pub grpc_tls_key: Option<PathBuf>,
    /// PEM CA bundle: when set, clients must present a certificate it signed (mTLS).
    #[arg(long, env = "GRPC_CLIENT_TLS_CACERT", requires = "grpc_tls_cert")]
    pub grpc_client_ca: Option<PathBuf>,
    /// Threads serving gRPC, each with the connections it was given (0: one per CPU, less one
    /// on the Redis backend). A connection stays on one thread, and the thread does its own
    /// Redis I/O, so a call wakes no other thread.
    #[arg(long, env = "TURNSTILE_GRPC_THREADS", default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=1024))]
    pub grpc_threads: u16,
    /// Most streams (calls) one gRPC connection may have open at once, advertised to the
    /// client (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); a client that opens more has them
    /// refused, and an HTTP/2 client such as Envoy opens another connection instead.
    #[arg(long, env = "TURNSTILE_GRPC_MAX_STREAMS", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    pub grpc_max_streams: u32,
    /// Most open gRPC connections. At it, a new connection from a peer holding fewer than the
    /// biggest peer takes the place of one of that peer's connections (in its handshake, or
    /// idle); otherwise it is closed at accept. Lowered at start-up when the open-files limit
    /// would not hold them all.
    #[arg(long, env = "TURNSTILE_GRPC_MAX_CONNECTIONS", default_value_t = 10_000)]
    pub grpc_max_connections: usize,
    /// Most open gRPC connections from one peer (an IPv4 address, or an IPv6 /64); past it
    /// its new ones are closed at accept, so one client cannot hold every connection. Never
    /// more than half of --grpc-max-connections (as fitted to the open-files limit). Envoy
    /// opens a few per worker thread.
    #[arg(long, env = "TURNSTILE_GRPC_MAX_CONNECTIONS_PER_PEER", default_value_t = 1_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub grpc_max_connections_per_peer: usize,
    /// A gRPC connection that has not finished TLS and sent the HTTP/2 preface by then is
    /// closed.
    #[arg(long, env = "TURNSTILE_GRPC_HANDSHAKE_TIMEOUT", value_parser = duration, default_value = "10s")]
    pub grpc_handshake_timeout: Duration,
    /// A gRPC connection silent this long is sent an HTTP/2 ping: idle clients that answer
    /// (Envoy's long-lived connections) stay, dead peers are found.
    #[arg(long, env = "TURNSTILE_GRPC_KEEPALIVE_INTERVAL", value_parser = positive_duration, default_value = "60s")]
    pub grpc_keepalive_interval: Duration,
    /// A connection whose ping is not answered within this is closed.
    #[arg(long, env = "TURNSTILE_GRPC_KEEPALIVE_TIMEOUT", value_parser = positive_duration, default_value = "20s")]
    pub grpc_keepalive_timeout: Duration,
    /// A gRPC connection this old (give or take a tenth, so that connections opened together
    /// do not all end together) is asked to close (HTTP/2 GOAWAY): its client opens a new
    /// one, which a load balancer may send to another instance, so a fleet that grew gets
    /// its share of long-lived connections.
    #[arg(long, env = "GRPC_MAX_CONNECTION_AGE", value_parser = positive_duration, default_value = "24h")]
    pub grpc_max_connection_age: Duration,
    /// How long a connection asked to close may still finish its calls before it is closed.
    #[arg(long, env = "GRPC_MAX_CONNECTION_AGE_GRACE", value_parser = positive_duration, default_value = "1h")]
    pub grpc_max_connection_age_grace: Duration,
}

impl GrpcArgs {
    pub fn addr(&self) -> SocketAddr {
        self.grpc_addr
            .unwrap_or(SocketAddr::new(self.grpc_host, self.grpc_port))
    }

    /// How many threads serve gRPC: as many as asked, else one per CPU, less one on the Redis
    /// backend. Each thread does its own Redis I/O, but a thread per CPU leaves no CPU to
    /// wait for Redis on (BENCHMARKS.md).
    pub fn threads(&self, backend: BackendKind) -> usize {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        match (self.grpc_threads, backend) {
            (0, BackendKind::Memory) => cpus,
            (0, BackendKind::Redis) => cpus.saturating_sub(1).max(1),
            (n, _) => usize::from(n),
        }
    }

    /// Each connection's HTTP/2 settings.
    pub fn http2(&self) -> Http2 {
        Http2 {
            keepalive_interval: self.grpc_keepalive_interval,
            keepalive_timeout: self.grpc_keepalive_timeout,
            max_streams: self.grpc_max_streams,
        }
    }

    pub fn max_age(&self) -> MaxAge {
        MaxAge {
            age: self.grpc_max_connection_age,
            grace: self.grpc_max_connection_age_grace,
        }
    }

    /// TLS from the certificate files, with client verification when a CA is given; HTTP/2
    /// only, as gRPC.
    pub fn tls_acceptor(&self) -> anyhow::Result<Option<TlsAcceptor>> {
        let (Some(cert), Some(key)) = (&self.grpc_tls_cert, &self.grpc_tls_key) else {
            if self.grpc_tls {
                anyhow::bail!(
                    "GRPC_SERVER_USE_TLS needs GRPC_SERVER_TLS_CERT and GRPC_SERVER_TLS_KEY"
                );
            }
            return Ok(None);
        };
        let chain = CertificateDer::pem_slice_iter(&read(cert)?)
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("no PEM certificate in {}", cert.display()))?;
        let key = PrivateKeyDer::from_pem_slice(&read(key)?)
            .with_context(|| format!("no PEM private key in {}", key.display()))?;
        let config = ServerConfig::builder();
        let config = match &self.grpc_client_ca {
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
}

#[cfg(test)]
mod tests {
    use super::super::{Cli, parse_serve};
    use super::*;
    use clap::Parser;

    #[test]
    fn serving_threads_leave_the_redis_backend_a_cpu() {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        for (args, threads) in [
            (&[][..], cpus),
            (&["--backend", "memory"][..], cpus),
            (&["--backend", "redis"][..], cpus.saturating_sub(1).max(1)),
            (
                &["--redis-url", "redis://127.0.0.1:1"][..],
                cpus.saturating_sub(1).max(1),
            ),
            (&["--backend", "redis", "--grpc-threads", "3"][..], 3),
            (&["--grpc-threads", "1"][..], 1),
        ] {
            assert_eq!(
                parse_serve(args).unwrap().grpc_threads(),
                threads,
                "{args:?}"
            );
        }
    }

    /// A gRPC connection's timers take any duration above zero, and refuse zero by name; the
    /// maximum age and its grace default to the reference's (24 h, 1 h).
    #[test]
    fn a_connections_timers_are_above_zero() {
        let flags = [
            "--grpc-keepalive-interval",
            "--grpc-keepalive-timeout",
            "--grpc-max-connection-age",
            "--grpc-max-connection-age-grace",
        ];
        for flag in flags {
            let line = |text| ["turnstile", "serve", flag, text];
            let err = Cli::try_parse_from(line("0s")).err().map(|e| e.to_string());
            assert!(
                err.as_deref()
                    .is_some_and(|e| e.contains("must be more than zero")),
                "{flag} 0s: {err:?}"
            );
            assert!(Cli::try_parse_from(line("1ms")).is_ok(), "{flag} 1ms");
        }
        let max_age = parse_serve(&[]).unwrap().grpc.max_age();
        assert_eq!(max_age.age, Duration::from_secs(86_400));
        assert_eq!(max_age.grace, Duration::from_secs(3_600));
    }

    /// Rows: the command line, and the address it listens on.
    #[test]
    fn the_address_overrides_host_and_port() {
        for (args, addr) in [
            (&[][..], "0.0.0.0:8081"),
            (
                &["--grpc-host", "127.0.0.2", "--grpc-port", "9"][..],
                "127.0.0.2:9",
            ),
            (
                &["--grpc-port", "9", "--grpc-addr", "127.0.0.3:10"][..],
                "127.0.0.3:10",
            ),
        ] {
            assert_eq!(
                parse_serve(args).unwrap().grpc.addr().to_string(),
                addr,
                "{args:?}"
            );
        }
    }

    /// TLS only when asked, and asking without a certificate is an error that says so.
    #[test]
    fn tls_needs_a_certificate_and_key() {
        assert!(
            parse_serve(&[])
                .unwrap()
                .grpc
                .tls_acceptor()
                .unwrap()
                .is_none()
        );
        let err = parse_serve(&["--grpc-tls"])
            .unwrap()
            .grpc
            .tls_acceptor()
            .err();
        assert!(
            err.as_ref()
                .is_some_and(|e| e.to_string().contains("needs GRPC_SERVER_TLS_CERT")),
            "{err:?}"
        );
        let missing = [
            "--grpc-tls-cert",
            "/nonexistent/c.pem",
            "--grpc-tls-key",
            "/nonexistent/k.pem",
        ];
        let err = parse_serve(&missing).unwrap().grpc.tls_acceptor().err();
        assert!(
            err.as_ref()
                .is_some_and(|e| e.to_string().contains("cannot read /nonexistent/c.pem")),
            "{err:?}"
        );
    }
}
