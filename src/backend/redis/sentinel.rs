//! Sentinel mode: connections to the master the Sentinels name, and a new set of them when the
//! master moves.
//!
//! A `ConnectionManager` reconnects to the address it was built with, which after a failover
//! is a replica (READONLY) or nothing. Worse, a master demoted while it runs keeps accepting
//! writes, which are lost, until the Sentinels get round to reconfiguring it (up to seconds).
//! So the Sentinels are asked for the master's address every `WATCH_INTERVAL`, and again when
//! a call fails or times out (one lookup at a time, at most every `MIN_LOOKUP_INTERVAL`); a
//! new master gets new connections. Requests in between fail fast; the service's failure
//! policy covers them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, MultiplexedConnection};
use ::redis::sentinel::{Sentinel, SentinelNodeConnectionInfo};
use ::redis::{AsyncConnectionConfig, Client, ConnectionAddr, ConnectionInfo, RedisError, TlsMode};
use arc_swap::ArcSwap;

use super::RedisConfig;
use super::client::{RoundRobin, manager_config, managers, unavailable};
use crate::decision::BackendError;

const MIN_LOOKUP_INTERVAL: Duration = Duration::from_millis(200);
/// How often the Sentinels are asked where the master is, failing or not.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// The current master and the connections to it.
struct Master {
    addr: ConnectionAddr,
    connections: RoundRobin<ConnectionManager>,
}

pub(in crate::backend::redis) struct SentinelPool {
    sentinel: tokio::sync::Mutex<Sentinel>,
    service: String,
    /// How to talk to the master (credentials, database, TLS).
    node: SentinelNodeConnectionInfo,
    master: ArcSwap<Master>,
    looking_up: AtomicBool,
    connections: usize,
    config: RedisConfig,
}

impl SentinelPool {
    pub(super) async fn connect(
        sentinels: Vec<ConnectionInfo>,
        service: &str,
        connections: usize,
        config: &RedisConfig,
    ) -> Result<Arc<SentinelPool>, BackendError> {
        let Some(first) = sentinels.first() else {
            return Err(BackendError::Unavailable("no Redis Sentinel URL".into()));
        };
        let mut node = SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(first.redis_settings().clone());
        if let ConnectionAddr::TcpTls { insecure, .. } = first.addr() {
            node = node.set_tls_mode(if *insecure {
                TlsMode::Insecure
            } else {
                TlsMode::Secure
            });
        }
        // Sentinels have no databases: the URL's applies to the master only.
        let sentinels: Vec<ConnectionInfo> = sentinels
            .iter()
            .map(|info| {
                let settings = info.redis_settings().clone().set_db(0);
                info.clone().set_redis_settings(settings)
            })
            .collect();
        let watchers = sentinels
            .iter()
            .map(|info| Client::open(info.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(unavailable)?;
        let mut sentinel = Sentinel::build(sentinels).map_err(unavailable)?;
        let client = sentinel
            .async_master_for(service, Some(&node))
            .await
            .map_err(unavailable)?;
        let master = Master {
            addr: client.get_connection_info().addr().clone(),
            connections: RoundRobin::new(managers(&client, connections, config).await?),
        };
        let pool = Arc::new(SentinelPool {
            sentinel: tokio::sync::Mutex::new(sentinel),
            service: service.into(),
            node,
            master: ArcSwap::from_pointee(master),
            looking_up: AtomicBool::new(false),
            connections,
            config: config.clone(),
        });
        tokio::spawn(watch(Arc::downgrade(&pool), watchers));
        Ok(pool)
    }

    pub(super) fn pick(&self) -> ConnectionManager {
        self.master.load().connections.pick()
    }

    /// Errors that the script or the arguments caused say nothing about the master.
    pub(super) fn trouble(self: &Arc<Self>, err: &RedisError) {
        let moved = err.is_io_error()
            || err.is_connection_dropped()
            || err.is_connection_refusal()
            || matches!(err.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"));
        if moved {
            self.reresolve();
        }
    }

    /// Ask the Sentinels for the master in the background, unless a lookup is under way.
    pub(super) fn reresolve(self: &Arc<Self>) {
        if self.looking_up.swap(true, Ordering::AcqRel) {
            return;
        }
        let pool = Arc::clone(self);
        tokio::spawn(async move {
            let bound = pool.config.connect_timeout;
            match tokio::time::timeout(bound, pool.lookup()).await {
                Ok(Ok(client)) => pool.follow(client),
                Ok(Err(err)) => {
                    tracing::warn!(%err, "asking the Redis Sentinels for the master failed")
                }
                Err(_) => {
                    tracing::warn!("the Redis Sentinels did not name a master within {bound:?}")
                }
            }
            tokio::time::sleep(MIN_LOOKUP_INTERVAL).await;
            pool.looking_up.store(false, Ordering::Release);
        });
    }

    async fn lookup(&self) -> Result<Client, RedisError> {
        let mut sentinel = self.sentinel.lock().await;
        sentinel
            .async_master_for(&self.service, Some(&self.node))
            .await
    }

    /// Switch to the master `client` points at, if it is a new one. The new connections are
    /// made lazily, by the first calls on them.
    fn follow(&self, client: Client) {
        let addr = client.get_connection_info().addr().clone();
        if addr == self.master.load().addr {
            return;
        }
        let made: Result<Vec<_>, _> = (0..self.connections)
            .map(|_| {
                ConnectionManager::new_lazy_with_config(
                    client.clone(),
                    manager_config(&self.config),
                )
            })
            .collect();
        match made {
            Ok(connections) => {
                tracing::info!(master = %addr, "the Redis master moved; following it");
                self.master.store(Arc::new(Master {
                    addr,
                    connections: RoundRobin::new(connections),
                }));
            }
            Err(err) => {
                tracing::warn!(%err, "could not set up connections to the new Redis master")
            }
        }
    }
}

/// Until the pool is dropped, ask a Sentinel every `WATCH_INTERVAL` for the master's address
/// (a cheap query on one kept connection) and look the master up properly when it changed.
async fn watch(pool: Weak<SentinelPool>, sentinels: Vec<Client>) {
    let mut connection: Option<MultiplexedConnection> = None;
    let mut next = 0;
    loop {
        tokio::time::sleep(WATCH_INTERVAL).await;
        let Some(pool) = pool.upgrade() else { return };
        let bound = pool.config.connect_timeout;
        if connection.is_none() {
            let config = AsyncConnectionConfig::new().set_connection_timeout(Some(bound));
            let client = &sentinels[next % sentinels.len()];
            connection = client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .ok();
        }
        let Some(sentinel) = &mut connection else {
            next += 1;
            continue;
        };
        let ask = ::redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&pool.service)
            .clone();
        match tokio::time::timeout(bound, ask.query_async::<Option<(String, u16)>>(sentinel)).await
        {
            Ok(Ok(Some((host, port)))) => {
                let moved = match &pool.master.load().addr {
                    ConnectionAddr::Tcp(h, p)
                    | ConnectionAddr::TcpTls {
                        host: h, port: p, ..
                    } => *h != host || *p != port,
                    _ => false,
                };
                if moved {
                    pool.reresolve();
                }
            }
            Ok(Ok(None)) => {}
            Ok(Err(_)) | Err(_) => {
                connection = None;
                next += 1;
            }
        }
    }
}
