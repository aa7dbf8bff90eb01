//! Connections: a few multiplexed connections used round-robin, built for the configured
//! mode. Reconnecting is the connections' own job (redis-rs `ConnectionManager`, and the
//! Cluster client, which also follows MOVED/ASK and refreshes the topology); following a
//! Sentinel failover is `sentinel`'s.

use std::sync::Arc;

use ::redis::aio::ConnectionManager;
use ::redis::cluster::ClusterClientBuilder;
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use ::redis::{Cmd, ConnectionInfo, ErrorKind, FromRedisValue, RedisError, RedisResult, Value};

use super::client::{RoundRobin, certificates, client, managers, resolve, unavailable};
use super::sentinel::{SentinelPool, SentinelWatch};
use super::slot_watch::SlotWatch;
use super::{Learned, RedisConfig, RedisMode, Wait};
use crate::decision::BackendError;

pub(super) enum Pool {
    Single(RoundRobin<ConnectionManager>),
    Sentinel(Box<SentinelPool>),
    /// The connections, and the backend's watch on the slot map (None when no seed
    /// answered it at first).
    Cluster(RoundRobin<ClusterConnection>, Option<Arc<SlotWatch>>),
}

impl Pool {
    pub(super) async fn connect(
        config: &RedisConfig,
        learned: &Learned,
    ) -> Result<Pool, BackendError> {
        let infos = config
            .urls
            .iter()
            .map(|url| resolve(url, config))
            .collect::<Result<Vec<_>, _>>()?;
        let connections = config.connections.max(1);
        let bounded = tokio::time::timeout(config.connect_timeout, async {
            match &config.mode {
                RedisMode::Single => match <[ConnectionInfo; 1]>::try_from(infos) {
                    Ok([info]) => {
                        let client = client(info, &config.tls).map_err(unavailable)?;
                        let managers = managers(&client, connections, config).await?;
                        Ok(Pool::Single(RoundRobin::new(managers)))
                    }
                    Err(infos) => Err(BackendError::Unavailable(format!(
                        "single Redis mode takes exactly one URL, got {}",
                        infos.len()
                    ))),
                },
                RedisMode::Sentinel { master } => {
                    // One watch per backend, started by its first pool.
                    let switches = &learned.switches;
                    let watch = learned
                        .sentinel
                        .get_or_try_init(|| {
                            SentinelWatch::start(infos, master, config, Arc::clone(switches))
                        })
                        .await?;
                    SentinelPool::connect(Arc::clone(watch), connections, config)
                        .await
                        .map(|pool| Pool::Sentinel(Box::new(pool)))
                }
                RedisMode::Cluster => {
                    if infos.is_empty() {
                        return Err(BackendError::Unavailable("no Redis Cluster URL".into()));
                    }
                    let mut builder = ClusterClientBuilder::new(infos.clone());
                    if let Some(certs) = certificates(&config.tls) {
                        builder = builder.certs(certs);
                    }
                    let client = builder
                        .connection_timeout(config.connect_timeout)
                        // Redirects are followed at once; waits only matter for TRYAGAIN or
                        // CLUSTERDOWN, and a rate-limit decision cannot wait long anyway.
                        .retries(3)
                        .min_retry_wait(5)
                        .max_retry_wait(100)
                        .build()
                        .map_err(unavailable)?;
                    let mut all = Vec::with_capacity(connections);
                    for _ in 0..connections {
                        all.push(client.get_async_connection().await.map_err(unavailable)?);
                    }
                    // One watch per backend, started by its first pool.
                    let watch = learned
                        .slots
                        .get_or_init(|| {
                            SlotWatch::start(&infos, config, Arc::clone(&learned.switches))
                        })
                        .await;
                    Ok(Pool::Cluster(RoundRobin::new(all), watch.clone()))
                }
            }
        })
        .await;
        bounded.unwrap_or_else(|_| {
            Err(BackendError::Unavailable(format!(
                "could not connect to Redis within {:?}",
                config.connect_timeout
            )))
        })
    }

    pub(super) fn is_cluster(&self) -> bool {
        matches!(self, Pool::Cluster(..))
    }

    /// Send one command on the next connection.
    pub(super) async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        match self {
            Pool::Single(pool) => cmd.query_async(&mut pool.pick()).await,
            Pool::Sentinel(pool) => cmd.query_async(&mut pool.pick()).await,
            Pool::Cluster(pool, _) => cmd.query_async(&mut pool.pick()).await,
        }
    }

    /// Send `cmd`, then, with `wait`, `WAIT` for that many replicas (within its timeout) on
    /// the same connection in one write: `cmd`'s reply once enough replicas have its writes,
    /// an error when fewer acknowledged them in time. A Cluster routes the pair by `cmd`'s key.
    pub(super) async fn query_replicated<T: FromRedisValue>(
        &self,
        cmd: &Cmd,
        wait: Option<Wait>,
    ) -> RedisResult<T> {
        let Some(wait) = wait else {
            return self.query(cmd).await;
        };
        let mut pipe = ::redis::pipe();
        // Each reply as it came, an error reply included: the caller reads `cmd`'s errors by
        // their kind (a missing function, a lost script), which a failed pipeline's hides.
        pipe.ignore_errors()
            .add_command(cmd.clone())
            .cmd("WAIT")
            .arg(wait.replicas)
            .arg(wait.timeout.as_millis().max(1) as u64);
        let replies: Vec<Value> = match self {
            Pool::Single(pool) => pipe.query_async(&mut pool.pick()).await?,
            Pool::Sentinel(pool) => pipe.query_async(&mut pool.pick()).await?,
            Pool::Cluster(pool, _) => pipe.query_async(&mut pool.pick()).await?,
        };
        let malformed =
            || RedisError::from((ErrorKind::Parse, "a pipeline of two replied otherwise"));
        let [reply, acknowledged] = <[Value; 2]>::try_from(replies).map_err(|_| malformed())?;
        let reply = T::from_redis_value(reply.extract_error()?)?;
        let acknowledged = u32::from_redis_value(acknowledged.extract_error()?)?;
        if acknowledged < wait.replicas {
            return Err(RedisError::from((
                ErrorKind::Extension,
                "too few replicas",
                format!(
                    "{acknowledged} of {} replicas acknowledged the call within {:?}",
                    wait.replicas, wait.timeout
                ),
            )));
        }
        Ok(reply)
    }

    /// Send `cmd` to every master: each one's reply (or the error in its place) by its
    /// address, which is empty outside a Cluster (one master).
    pub(super) async fn every_master(&self, cmd: Cmd) -> RedisResult<Vec<(String, Value)>> {
        let Pool::Cluster(pool, _) = self else {
            return Ok(vec![(String::new(), self.query(&cmd).await?)]);
        };
        let all = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
        // Without a response policy, the replies come as a map from each node's address.
        match pool.pick().route_command(cmd, all).await? {
            Value::Map(replies) => Ok(replies
                .into_iter()
                .map(|(node, reply)| {
                    let node = String::from_redis_value(node).unwrap_or_default();
                    (node, reply)
                })
                .collect()),
            reply => Ok(vec![(String::new(), reply)]),
        }
    }

    /// A command failed: the master may have moved (Sentinel), or a master be down or its
    /// slots moved (Cluster).
    pub(super) fn trouble(&self, err: &RedisError) {
        match self {
            Pool::Single(_) => {}
            Pool::Sentinel(pool) => pool.trouble(err),
            Pool::Cluster(_, watch) => {
                if let Some(watch) = watch {
                    watch.trouble();
                }
            }
        }
    }

    /// A command did not answer in time: the master may be gone.
    pub(super) fn timed_out(&self) {
        match self {
            Pool::Single(_) => {}
            Pool::Sentinel(pool) => pool.timed_out(),
            Pool::Cluster(_, watch) => {
                if let Some(watch) = watch {
                    watch.trouble();
                }
            }
        }
    }
}
