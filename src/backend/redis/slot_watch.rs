//! Cluster mode: which master owns which slots, watched, so that a failover or a reshard is
//! noticed (and logged) once, when it happens.
//!
//! redis-rs' Cluster client follows MOVED and ASK by itself, and while a master is down it
//! sends that master's slots to its replica, which serves them once promoted. What it cannot
//! say is when that happened: until then the breaker, opened by the failures, would wait out
//! its backoff. So one backend's watch reads the slot map from one node every
//! `WATCH_INTERVAL`, and while calls fail (and for `TROUBLE_SPAN` after) from every node it
//! knows every `TROUBLE_TICK`: a promoted replica claims its slots in its own map first, the
//! other nodes learn it a moment later. When owners changed, it logs one line per move and
//! counts a switch, which closes the breaker at once.
//!
//! While in trouble, only a node's claim of slots for itself is taken: another node's map
//! may be older than the one already taken, and would move the slots back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use ::redis::aio::MultiplexedConnection;
use ::redis::{AsyncConnectionConfig, Client, ConnectionInfo, RedisError, Value};
use tokio::sync::Notify;

use super::RedisConfig;
use super::client::named;

/// How often the map is read while calls fail.
const TROUBLE_TICK: Duration = Duration::from_millis(20);
/// How long after the last failure the map is read at `TROUBLE_TICK`.
const TROUBLE_SPAN: Duration = Duration::from_secs(3);
/// How often the map is read otherwise.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// Slot ranges and the address of the master serving each, in slot order.
type SlotMap = Vec<(u16, u16, String)>;

/// A node's `CLUSTER SLOTS`: its slot map, and every node (masters and replicas) it names.
struct Seen {
    map: SlotMap,
    nodes: Vec<String>,
}

pub(in crate::backend::redis) struct SlotWatch {
    /// How to reach a node (credentials, TLS): the first seed's.
    template: ConnectionInfo,
    seeds: Vec<String>,
    config: RedisConfig,
    state: Mutex<Watched>,
    /// Wakes the watch from its slow interval.
    troubled: Arc<Notify>,
    in_trouble: AtomicBool,
    /// The backend's count of servers switched to (see `RedisBackend::switches`).
    switches: Arc<AtomicU64>,
}

struct Watched {
    map: SlotMap,
    /// Nodes to ask: the seeds, then the nodes of the latest map.
    nodes: Vec<String>,
    last_trouble: Option<Instant>,
}

impl SlotWatch {
    /// Read the map now (if a seed answers) and watch it until dropped.
    pub(super) async fn start(
        seeds: &[ConnectionInfo],
        config: &RedisConfig,
        switches: Arc<AtomicU64>,
    ) -> Option<Arc<SlotWatch>> {
        let template = seeds.first()?.clone();
        let nodes: Vec<String> = seeds.iter().map(|info| info.addr().to_string()).collect();
        let watch = Arc::new(SlotWatch {
            template,
            seeds: nodes.clone(),
            config: config.clone(),
            state: Mutex::new(Watched {
                map: Vec::new(),
                nodes,
                last_trouble: None,
            }),
            troubled: Arc::new(Notify::new()),
            in_trouble: AtomicBool::new(false),
            switches,
        });
        let mut asker = Asker::default();
        let seeds = watch.state().nodes.len();
        for _ in 0..seeds {
            if let Some((node, seen)) = asker.read_next(&watch).await {
                watch.compare(&node, seen, false);
                break;
            }
        }
        tokio::spawn(run(
            Arc::downgrade(&watch),
            asker,
            Arc::clone(&watch.troubled),
        ));
        Some(watch)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Watched> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A call failed or timed out: a master may be down, or its slots moved.
    pub(super) fn trouble(&self) {
        self.state().last_trouble = Some(Instant::now());
        if !self.in_trouble.swap(true, Ordering::AcqRel) {
            self.troubled.notify_one();
        }
    }

    fn client_for(&self, node: &str) -> Option<Client> {
        let (host, port) = node.rsplit_once(':')?;
        named(&self.template, host, port.parse().ok()?, &self.config.tls).ok()
    }

    /// Take `seen`, read from `node`, as the current map: log each move and count a switch.
    /// In trouble, only if every move in it goes to `node` itself (see the module's doc). A
    /// master claims slots only once it serves them (a replica once promoted, a node once a
    /// migration handed it the slot), so the map is the evidence; the breaker opens again if
    /// the calls say otherwise.
    fn compare(&self, node: &str, seen: Seen, trouble: bool) {
        let mut state = self.state();
        // The seeds and the nodes of the latest map: a node gone from the Cluster is dropped.
        let mut nodes = self.seeds.clone();
        nodes.extend(seen.nodes.into_iter().filter(|n| !self.seeds.contains(n)));
        state.nodes = nodes;
        if state.map == seen.map {
            return;
        }
        let moves = moves(&state.map, &seen.map);
        if trouble && moves.iter().any(|(_, to, _)| to != node) {
            return;
        }
        // The first map read is no move.
        let first = state.map.is_empty();
        state.map = seen.map;
        drop(state);
        if first || moves.is_empty() {
            return;
        }
        for (from, to, slots) in &moves {
            tracing::info!(%from, %to, slots, "Redis Cluster slots moved to another master");
        }
        self.switches.fetch_add(1, Ordering::AcqRel);
    }
}

/// Kept connections to the nodes asked.
#[derive(Default)]
struct Asker {
    connections: HashMap<String, MultiplexedConnection>,
    /// The next node to ask outside trouble.
    next: usize,
}

impl Asker {
    /// What the next node in turn sees, and which node that is.
    async fn read_next(&mut self, watch: &SlotWatch) -> Option<(String, Seen)> {
        let node = {
            let state = watch.state();
            let node = state
                .nodes
                .get(self.next % state.nodes.len().max(1))?
                .clone();
            self.next += 1;
            node
        };
        let connection = self.connection(watch, &node).await?;
        let seen = ask_node(watch, &node, connection).await;
        if seen.is_none() {
            self.connections.remove(&node);
        }
        Some((node, seen?))
    }

    /// What every known node sees, asked at once (a node that does not answer holds up no
    /// other); with the node each answer came from.
    async fn read_all(&mut self, watch: &SlotWatch) -> Vec<(String, Seen)> {
        let nodes = watch.state().nodes.clone();
        let reads = nodes.into_iter().map(|node| {
            let kept = self.connections.get(&node).cloned();
            async move {
                let connection = match kept {
                    Some(connection) => Some(connection),
                    None => connect(watch, &node).await,
                };
                let seen = match &connection {
                    Some(connection) => ask_node(watch, &node, connection.clone()).await,
                    None => None,
                };
                (node, connection, seen)
            }
        });
        let mut answers = Vec::new();
        for (node, connection, seen) in futures_util::future::join_all(reads).await {
            match (connection, seen) {
                (Some(connection), Some(seen)) => {
                    self.connections.insert(node.clone(), connection);
                    answers.push((node, seen));
                }
                _ => {
                    self.connections.remove(&node);
                }
            }
        }
        answers
    }

    /// The kept connection to `node`, made if there is none (None if it does not answer).
    async fn connection(&mut self, watch: &SlotWatch, node: &str) -> Option<MultiplexedConnection> {
        if let Some(connection) = self.connections.get(node) {
            return Some(connection.clone());
        }
        let connection = connect(watch, node).await?;
        self.connections
            .insert(node.to_string(), connection.clone());
        Some(connection)
    }
}

/// A connection to `node`, within the connect timeout.
async fn connect(watch: &SlotWatch, node: &str) -> Option<MultiplexedConnection> {
    let bound = watch.config.connect_timeout;
    let client = watch.client_for(node)?;
    let config = AsyncConnectionConfig::new().set_connection_timeout(Some(bound));
    let made = tokio::time::timeout(
        bound,
        client.get_multiplexed_async_connection_with_config(&config),
    )
    .await;
    made.ok()?.ok()
}

/// `CLUSTER SLOTS` on `node`, bounded by the connect timeout.
async fn ask_node(
    watch: &SlotWatch,
    node: &str,
    mut connection: MultiplexedConnection,
) -> Option<Seen> {
    let mut ask = ::redis::cmd("CLUSTER");
    ask.arg("SLOTS");
    let bound = watch.config.connect_timeout;
    match tokio::time::timeout(bound, ask.query_async::<Value>(&mut connection)).await {
        Ok(Ok(reply)) => parse(reply, node).ok(),
        Ok(Err(_)) | Err(_) => None,
    }
}

/// Until the watch is dropped: read the map, often while calls fail, and compare.
async fn run(watch: Weak<SlotWatch>, mut asker: Asker, troubled: Arc<Notify>) {
    loop {
        let recent = {
            let Some(watch) = watch.upgrade() else { return };
            let recent = watch
                .state()
                .last_trouble
                .is_some_and(|at| at.elapsed() < TROUBLE_SPAN);
            if !recent {
                watch.in_trouble.store(false, Ordering::Release);
            }
            recent
        };
        if recent {
            tokio::time::sleep(TROUBLE_TICK).await;
        } else {
            tokio::select! {
                () = tokio::time::sleep(WATCH_INTERVAL) => {}
                () = troubled.notified() => {}
            }
        }
        let Some(watch) = watch.upgrade() else { return };
        if recent {
            for (node, seen) in asker.read_all(&watch).await {
                watch.compare(&node, seen, true);
            }
        } else if let Some((node, seen)) = asker.read_next(&watch).await {
            watch.compare(&node, seen, false);
        }
    }
}

/// `CLUSTER SLOTS` as ranges and their masters' `host:port`, sorted, and every node named
/// (masters and replicas); an empty host means the node that answered (`asked`).
fn parse(reply: Value, asked: &str) -> Result<Seen, RedisError> {
    let asked_host = asked.rsplit_once(':').map_or(asked, |(host, _)| host);
    let mut seen = Seen {
        map: SlotMap::new(),
        nodes: Vec::new(),
    };
    let Value::Array(ranges) = reply else {
        return Ok(seen);
    };
    for range in ranges {
        let Value::Array(range) = range else { continue };
        let (Some(Value::Int(start)), Some(Value::Int(end))) = (range.first(), range.get(1)) else {
            continue;
        };
        let mut nodes = Vec::new();
        for node in &range[2..] {
            let Value::Array(node) = node else { continue };
            let (Some(host), Some(Value::Int(port))) = (node.first(), node.get(1)) else {
                continue;
            };
            let host: String = ::redis::from_redis_value_ref(host)?;
            let host = if host.is_empty() { asked_host } else { &host };
            nodes.push(format!("{host}:{port}"));
        }
        let Some(master) = nodes.first() else {
            continue;
        };
        seen.map.push((*start as u16, *end as u16, master.clone()));
        for node in nodes {
            if !seen.nodes.contains(&node) {
                seen.nodes.push(node);
            }
        }
    }
    seen.map.sort();
    Ok(seen)
}

/// The moves from `old` to `new`: each (from, to) pair of masters with the number of slots it
/// moved.
fn moves(old: &SlotMap, new: &SlotMap) -> Vec<(String, String, usize)> {
    let owner = |map: &SlotMap, slot: u16| -> Option<String> {
        map.iter()
            .find(|(start, end, _)| (*start..=*end).contains(&slot))
            .map(|(_, _, node)| node.clone())
    };
    let mut moves: Vec<(String, String, usize)> = Vec::new();
    for slot in 0..16_384u16 {
        let (Some(from), Some(to)) = (owner(old, slot), owner(new, slot)) else {
            continue;
        };
        if from == to {
            continue;
        }
        match moves.iter_mut().find(|(f, t, _)| *f == from && *t == to) {
            Some((_, _, slots)) => *slots += 1,
            None => moves.push((from, to, 1)),
        }
    }
    moves
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moves_are_grouped_by_masters_and_counted_in_slots() {
        let a = || "10.0.0.1:7000".to_string();
        let b = || "10.0.0.2:7000".to_string();
        let c = || "10.0.0.3:7000".to_string();
        let old = vec![(0, 99, a()), (100, 199, b())];
        assert!(moves(&old, &old).is_empty());
        let failover = vec![(0, 99, c()), (100, 199, b())];
        assert_eq!(moves(&old, &failover), vec![(a(), c(), 100)]);
        let reshard = vec![(0, 89, a()), (90, 109, b()), (110, 199, b())];
        assert_eq!(moves(&old, &reshard), vec![(a(), b(), 10)]);
    }

    #[test]
    fn an_empty_host_is_the_node_asked() {
        let reply = Value::Array(vec![Value::Array(vec![
            Value::Int(0),
            Value::Int(16383),
            Value::Array(vec![
                Value::BulkString(b"".to_vec()),
                Value::Int(7001),
                Value::BulkString(b"id".to_vec()),
            ]),
        ])]);
        let seen = parse(reply, "127.0.0.5:7000").unwrap();
        assert_eq!(seen.map, vec![(0, 16383, "127.0.0.5:7001".to_string())]);
        assert_eq!(seen.nodes, vec!["127.0.0.5:7001".to_string()]);
    }
}
