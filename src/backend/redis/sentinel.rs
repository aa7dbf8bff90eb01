//! Sentinel mode: connections to the master the Sentinels name, and new ones as soon as they
//! name another.
//!
//! A `ConnectionManager` reconnects to the address it was built with, which after a failover
//! is a replica (READONLY) or nothing. Worse, a master demoted while it runs keeps accepting
//! writes, which are lost, until the Sentinels get round to reconfiguring it (up to seconds).
//! So one watch per backend ([`SentinelWatch`]) follows the master: it hears the Sentinels'
//! `+switch-master` announcement the moment they make it, and asks them where the master is
//! every `WATCH_INTERVAL` and when a call fails (in case an announcement was missed). A new
//! master that answers is followed at once: each serving thread's connections are replaced at
//! their next call, and the switch counts as evidence that the backend works again (the
//! breaker closes on it). Requests in between fail fast; the failure policy covers them.
//!
//! The Sentinels are asked with plain commands rather than redis-rs' `Sentinel`, which
//! reports a dead master it was told about as a failure of the Sentinels: here, that the
//! Sentinels did not answer and that the master they name does not are told apart, and
//! neither is worth more than a debug line while a failover runs.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, MultiplexedConnection};
use ::redis::{AsyncConnectionConfig, Client, ConnectionInfo, RedisError};
use arc_swap::ArcSwap;
use futures_util::StreamExt;

use super::RedisConfig;
use super::client::{RoundRobin, client, manager_config, managers, named, unavailable};
use crate::decision::BackendError;

const MIN_LOOKUP_INTERVAL: Duration = Duration::from_millis(200);
/// How often the Sentinels are asked where the master is, failing or not.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);
/// Wait before subscribing again to a Sentinel that dropped or refused the subscription.
const RESUBSCRIBE_AFTER: Duration = Duration::from_secs(1);
const SWITCH_CHANNEL: &str = "+switch-master";

/// The master the Sentinels name, and how many times it changed before.
struct Named {
    host: String,
    port: u16,
    client: Client,
    /// Counts the masters followed: a serving thread whose connections are of an older one
    /// replaces them.
    generation: u64,
}

/// The Sentinels, and how to reach the masters they name.
struct Sentinels {
    service: String,
    clients: Vec<Client>,
    /// How to talk to the master (credentials, database, TLS): the first Sentinel URL's.
    template: ConnectionInfo,
    config: RedisConfig,
}

impl Sentinels {
    /// Where the first Sentinel that answers says the master is.
    async fn ask(&self) -> Result<(String, u16), BackendError> {
        let bound = self.config.connect_timeout;
        let mut last = String::from("no Sentinel answered");
        for sentinel in &self.clients {
            let ask = async {
                let config = AsyncConnectionConfig::new().set_connection_timeout(Some(bound));
                let mut connection = sentinel
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?;
                self.master_addr(&mut connection).await
            };
            match tokio::time::timeout(bound, ask).await {
                Ok(Ok(Some(addr))) => return Ok(addr),
                Ok(Ok(None)) => {
                    last = format!("the Sentinels know no master named {}", self.service)
                }
                Ok(Err(err)) => last = format!("no Sentinel answered: {err}"),
                Err(_) => last = format!("no Sentinel answered within {bound:?}"),
            }
        }
        Err(BackendError::Unavailable(last))
    }

    async fn master_addr(
        &self,
        sentinel: &mut MultiplexedConnection,
    ) -> Result<Option<(String, u16)>, RedisError> {
        ::redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg(&self.service)
            .query_async(sentinel)
            .await
    }

    /// A client for the server at `host:port`, if it answers as a master.
    async fn check(&self, host: &str, port: u16) -> Result<Client, BackendError> {
        let master = named(&self.template, host, port, &self.config.tls).map_err(unavailable)?;
        let bound = self.config.connect_timeout;
        let role = async {
            let config = AsyncConnectionConfig::new().set_connection_timeout(Some(bound));
            let mut connection = master
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            let role: Vec<::redis::Value> =
                ::redis::cmd("ROLE").query_async(&mut connection).await?;
            Ok::<_, RedisError>(
                matches!(role.first(), Some(::redis::Value::BulkString(r)) if r == b"master"),
            )
        };
        let named = format!(
            "the Sentinels name {host}:{port} as the master of {}",
            self.service
        );
        match tokio::time::timeout(bound, role).await {
            Ok(Ok(true)) => Ok(master),
            Ok(Ok(false)) => Err(BackendError::Unavailable(format!(
                "{named}, but it is not one (yet)"
            ))),
            Ok(Err(err)) => Err(BackendError::Unavailable(format!(
                "{named}, which does not answer: {err}"
            ))),
            Err(_) => Err(BackendError::Unavailable(format!(
                "{named}, which does not answer within {bound:?}"
            ))),
        }
    }
}

/// One backend's view of the master, shared by the serving threads' pools.
pub(in crate::backend::redis) struct SentinelWatch {
    sentinels: Sentinels,
    master: ArcSwap<Named>,
    looking_up: AtomicBool,
    /// The backend's count of servers switched to (see `RedisBackend::switches`).
    switches: Arc<AtomicU64>,
}

impl SentinelWatch {
    /// Ask the Sentinels for the master, check that it answers, and start watching them.
    pub(super) async fn start(
        urls: Vec<ConnectionInfo>,
        service: &str,
        config: &RedisConfig,
        switches: Arc<AtomicU64>,
    ) -> Result<Arc<SentinelWatch>, BackendError> {
        let Some(template) = urls.first().cloned() else {
            return Err(BackendError::Unavailable("no Redis Sentinel URL".into()));
        };
        // Sentinels have no databases: the URL's applies to the master only.
        let clients = urls
            .iter()
            .map(|info| {
                let settings = info.redis_settings().clone().set_db(0);
                client(info.clone().set_redis_settings(settings), &config.tls)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(unavailable)?;
        let sentinels = Sentinels {
            service: service.into(),
            clients,
            template,
            config: config.clone(),
        };
        let (host, port) = sentinels.ask().await?;
        let client = sentinels.check(&host, port).await?;
        let watch = Arc::new(SentinelWatch {
            sentinels,
            master: ArcSwap::from_pointee(Named {
                host,
                port,
                client,
                generation: 0,
            }),
            looking_up: AtomicBool::new(false),
            switches,
        });
        for sentinel in 0..watch.sentinels.clients.len() {
            tokio::spawn(listen(Arc::downgrade(&watch), sentinel));
        }
        tokio::spawn(poll(Arc::downgrade(&watch)));
        Ok(watch)
    }

    /// Follow the master at `host:port` if it is a new one and answers.
    async fn follow(&self, host: String, port: u16) {
        let current = self.master.load();
        if current.host == host && current.port == port {
            return;
        }
        match self.sentinels.check(&host, port).await {
            Ok(client) => {
                let current = self.master.load();
                if current.host == host && current.port == port {
                    return;
                }
                tracing::info!(
                    from = %format!("{}:{}", current.host, current.port),
                    to = %format!("{host}:{port}"),
                    master = %self.sentinels.service,
                    "the Redis master moved; following it"
                );
                self.master.store(Arc::new(Named {
                    host,
                    port,
                    client,
                    generation: current.generation + 1,
                }));
                self.switches.fetch_add(1, Ordering::AcqRel);
            }
            // Expected while a failover runs: the poll and the next announcement try again.
            Err(error) => tracing::debug!(%error, "not following the master the Sentinels name"),
        }
    }

    /// Ask the Sentinels for the master in the background, unless a lookup is under way.
    pub(super) fn reresolve(self: &Arc<Self>) {
        if self.looking_up.swap(true, Ordering::AcqRel) {
            return;
        }
        let watch = Arc::clone(self);
        tokio::spawn(async move {
            match watch.sentinels.ask().await {
                Ok((host, port)) => watch.follow(host, port).await,
                Err(error) => tracing::debug!(%error, "asking the Redis Sentinels for the master"),
            }
            tokio::time::sleep(MIN_LOOKUP_INTERVAL).await;
            watch.looking_up.store(false, Ordering::Release);
        });
    }
}

/// Until the watch is dropped, hear sentinel `index`'s `+switch-master` announcements and
/// follow the master they name (`<name> <old-ip> <old-port> <new-ip> <new-port>`).
async fn listen(watch: Weak<SentinelWatch>, index: usize) {
    loop {
        let Some(sentinel) = watch.upgrade().map(|w| w.sentinels.clients[index].clone()) else {
            return;
        };
        match sentinel.get_async_pubsub().await {
            Ok(mut pubsub) => match pubsub.subscribe(SWITCH_CHANNEL).await {
                Ok(()) => {
                    let mut messages = pubsub.on_message();
                    while let Some(message) = messages.next().await {
                        let Some(watch) = watch.upgrade() else { return };
                        let Ok(text) = message.get_payload::<String>() else {
                            continue;
                        };
                        let fields: Vec<&str> = text.split_whitespace().collect();
                        if let [name, _, _, host, port] = fields[..]
                            && name == watch.sentinels.service
                            && let Ok(port) = port.parse()
                        {
                            watch.follow(host.to_string(), port).await;
                        }
                    }
                }
                Err(error) => tracing::debug!(%error, "subscribing to a Redis Sentinel"),
            },
            Err(error) => tracing::debug!(%error, "subscribing to a Redis Sentinel"),
        }
        tokio::time::sleep(RESUBSCRIBE_AFTER).await;
    }
}

/// Until the watch is dropped, ask a Sentinel every `WATCH_INTERVAL` for the master's address
/// (a cheap query on one kept connection) and follow it when it changed.
async fn poll(watch: Weak<SentinelWatch>) {
    let mut connection: Option<MultiplexedConnection> = None;
    let mut next = 0;
    loop {
        tokio::time::sleep(WATCH_INTERVAL).await;
        let Some(watch) = watch.upgrade() else { return };
        let bound = watch.sentinels.config.connect_timeout;
        if connection.is_none() {
            let config = AsyncConnectionConfig::new().set_connection_timeout(Some(bound));
            let clients = &watch.sentinels.clients;
            let sentinel = &clients[next % clients.len()];
            connection = sentinel
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .ok();
        }
        let Some(sentinel) = &mut connection else {
            next += 1;
            continue;
        };
        match tokio::time::timeout(bound, watch.sentinels.master_addr(sentinel)).await {
            Ok(Ok(Some((host, port)))) => watch.follow(host, port).await,
            Ok(Ok(None)) => {}
            Ok(Err(_)) | Err(_) => {
                connection = None;
                next += 1;
            }
        }
    }
}

/// The current master's connections.
struct Master {
    generation: u64,
    connections: RoundRobin<ConnectionManager>,
}

/// One runtime's connections to the master its backend's watch names.
pub(in crate::backend::redis) struct SentinelPool {
    watch: Arc<SentinelWatch>,
    master: ArcSwap<Master>,
    connections: usize,
    config: RedisConfig,
}

impl SentinelPool {
    pub(super) async fn connect(
        watch: Arc<SentinelWatch>,
        connections: usize,
        config: &RedisConfig,
    ) -> Result<SentinelPool, BackendError> {
        let named = watch.master.load_full();
        let master = Master {
            generation: named.generation,
            connections: RoundRobin::new(managers(&named.client, connections, config).await?),
        };
        Ok(SentinelPool {
            watch,
            master: ArcSwap::from_pointee(master),
            connections,
            config: config.clone(),
        })
    }

    /// A connection to the master the watch names; when it names a new one, this runtime's
    /// connections are replaced first (made lazily, by the first calls on them).
    pub(super) fn pick(&self) -> ConnectionManager {
        let named = self.watch.master.load();
        let mine = self.master.load();
        if mine.generation == named.generation {
            return mine.connections.pick();
        }
        let made: Result<Vec<_>, _> = (0..self.connections)
            .map(|_| {
                ConnectionManager::new_lazy_with_config(
                    named.client.clone(),
                    manager_config(&self.config),
                )
            })
            .collect();
        match made {
            Ok(connections) => {
                let master = Arc::new(Master {
                    generation: named.generation,
                    connections: RoundRobin::new(connections),
                });
                self.master.store(Arc::clone(&master));
                master.connections.pick()
            }
            Err(err) => {
                tracing::warn!(%err, "could not set up connections to the new Redis master");
                mine.connections.pick()
            }
        }
    }

    /// Errors that the script or the arguments caused say nothing about the master.
    pub(super) fn trouble(&self, err: &RedisError) {
        let moved = err.is_io_error()
            || err.is_connection_dropped()
            || err.is_connection_refusal()
            || matches!(err.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"));
        if moved {
            self.watch.reresolve();
        }
    }

    /// A call did not answer in time: the master may be gone.
    pub(super) fn timed_out(&self) {
        self.watch.reresolve();
    }
}
