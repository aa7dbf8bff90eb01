//! Connections to one Redis server: opening them (TLS, auth, URLs), keeping a few
//! multiplexed ones used in turn, and naming what went wrong. Both ways of reaching a server,
//! directly (`connect`) and through Sentinel (`sentinel`), build on this.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{
    AsyncConnectionConfig, Client, ClientTlsConfig, ConnectionAddr, ConnectionInfo,
    IntoConnectionInfo, RedisError, RedisResult, TlsCertificates,
};

use super::{RedisConfig, RedisTls};
use crate::decision::BackendError;

/// Connections picked in turn, so concurrent requests spread over them.
pub(super) struct RoundRobin<C> {
    connections: Vec<C>,
    next: AtomicUsize,
}

impl<C: Clone> RoundRobin<C> {
    pub(super) fn new(connections: Vec<C>) -> RoundRobin<C> {
        assert!(!connections.is_empty());
        RoundRobin {
            connections,
            next: AtomicUsize::new(0),
        }
    }

    pub(super) fn pick(&self) -> C {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.connections.len();
        self.connections[i].clone()
    }
}

/// `count` managed connections to the server `client` points at. The first connection is
/// made directly so a refused connection or a bad password is reported as such, not as a
/// timeout of the manager's retries.
pub(super) async fn managers(
    client: &Client,
    count: usize,
    config: &RedisConfig,
) -> Result<Vec<ConnectionManager>, BackendError> {
    let probe = AsyncConnectionConfig::new().set_connection_timeout(Some(config.connect_timeout));
    let mut probe = client
        .get_multiplexed_async_connection_with_config(&probe)
        .await
        .map_err(unavailable)?;
    ::redis::cmd("PING")
        .query_async::<()>(&mut probe)
        .await
        .map_err(unavailable)?;
    let mut all = Vec::with_capacity(count);
    for _ in 0..count {
        let manager = ConnectionManager::new_with_config(client.clone(), manager_config(config))
            .await
            .map_err(unavailable)?;
        all.push(manager);
    }
    Ok(all)
}

/// Connections time out only when being made; a call is bounded by the backend's own timer.
pub(super) fn manager_config(config: &RedisConfig) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(config.connect_timeout))
        .set_response_timeout(None)
        .set_min_delay(Duration::from_millis(50))
        .set_max_delay(Duration::from_secs(1))
}

/// Parse a configured URL; a bare `host:port` gets `redis://`.
/// The certificates redis-rs needs, when any are configured.
pub(super) fn certificates(tls: &RedisTls) -> Option<TlsCertificates> {
    (tls.ca.is_some() || tls.client.is_some()).then(|| TlsCertificates {
        client_tls: tls
            .client
            .clone()
            .map(|(client_cert, client_key)| ClientTlsConfig {
                client_cert,
                client_key,
            }),
        root_cert: tls.ca.clone(),
    })
}

/// A client for one server, with the configured certificates.
pub(super) fn client(info: ConnectionInfo, tls: &RedisTls) -> RedisResult<Client> {
    match certificates(tls) {
        Some(certs) => Client::build_with_tls(info, certs),
        None => Client::open(info),
    }
}

/// A client for the server at `host:port` that a Sentinel or a Cluster node named, reached as
/// `template` (credentials, database, TLS) is.
pub(super) fn named(
    template: &ConnectionInfo,
    host: &str,
    port: u16,
    tls: &RedisTls,
) -> RedisResult<Client> {
    let addr = match template.addr() {
        ConnectionAddr::TcpTls { insecure, .. } => ConnectionAddr::TcpTls {
            host: host.into(),
            port,
            insecure: *insecure,
            tls_params: None,
        },
        _ => ConnectionAddr::Tcp(host.into(), port),
    };
    client(template.clone().set_addr(addr), tls)
}

/// A URL with the defaults the reference's variables set: TLS for bare addresses, and
/// credentials where the URL has none.
pub(super) fn resolve(url: &str, config: &RedisConfig) -> Result<ConnectionInfo, BackendError> {
    let info = if config.tls_by_default && !url.contains("://") {
        parse(&format!("rediss://{url}"))?
    } else {
        parse(url)?
    };
    let Some(auth) = &config.auth else {
        return Ok(info);
    };
    if info.redis_settings().password().is_some() {
        return Ok(info);
    }
    let settings = match auth.split_once(':') {
        Some((user, password)) => info
            .redis_settings()
            .clone()
            .set_username(user)
            .set_password(password),
        None => info.redis_settings().clone().set_password(auth),
    };
    Ok(info.set_redis_settings(settings))
}

pub(super) fn parse(url: &str) -> Result<ConnectionInfo, BackendError> {
    let full = if url.contains("://") {
        url.to_string()
    } else {
        format!("redis://{url}")
    };
    full.as_str().into_connection_info().map_err(|err| {
        BackendError::Unavailable(format!("invalid Redis URL {}: {err}", redact(url)))
    })
}

/// The URL with its credentials masked, for messages and logs.
pub(super) fn redact(url: &str) -> String {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..].find('/').map_or(url.len(), |i| start + i);
    match url[start..end].rfind('@') {
        Some(at) => format!("{}***{}", &url[..start], &url[start + at..]),
        None => url.to_string(),
    }
}

pub(super) fn unavailable(err: RedisError) -> BackendError {
    BackendError::Unavailable(err.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_redacted_and_bare_addresses_get_a_scheme() {
        assert_eq!(
            redact("rediss://user:secret@host:6380/2"),
            "rediss://***@host:6380/2"
        );
        assert_eq!(redact("redis://host:1/0"), "redis://host:1/0");
        assert_eq!(redact("u:p@host:1"), "***@host:1");
        let info = parse("10.0.0.1:7000").unwrap();
        assert_eq!(info.addr().to_string(), "10.0.0.1:7000");
        assert!(parse("redis://host:notaport").is_err());
    }
}
