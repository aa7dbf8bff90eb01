//! Real `redis-server` (or `valkey-server`) processes for tests: a standalone server
//! (optionally a replica), Sentinels, and a Cluster of masters. Each listens on a free
//! 127.0.0.1 port with its files in a temporary directory, never persists anything, and is
//! killed by PID when dropped. Every wait is bounded, and a server that does not come up fails
//! the test with its log.
//!
//! Which server runs is an [`Engine`]: Redis from the PATH, or Valkey from `VALKEY_BIN` (the
//! directory holding `valkey-server` and `valkey-cli`, which scripts/test.sh installs), so
//! that a test can run the same rows on both.

use std::fs;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::thread::sleep;
use std::time::{Duration, Instant};

use redis::FromRedisValue;

use super::turnstile::signal;

/// How long a server may take to answer PING after being started.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a Cluster may take to be created and agree on its slots.
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(30);
const POLL: Duration = Duration::from_millis(10);
/// A server's TLS port, when its configuration names one with `{tls-port}`, is its port plus
/// this (kept free alongside the port and the Cluster bus port +10000).
const TLS_PORT_OFFSET: u16 = 20_000;

/// Which server implementation a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// `redis-server` and `redis-cli` on the PATH.
    Redis,
    /// `valkey-server` and `valkey-cli` in the directory `VALKEY_BIN` names.
    Valkey,
}

/// Every engine, for tests that run their rows on each.
pub const ENGINES: [Engine; 2] = [Engine::Redis, Engine::Valkey];

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Redis => "redis",
            Engine::Valkey => "valkey",
        }
    }

    /// The engines installed here. Under `CI=true` a missing one fails the test; elsewhere it is
    /// skipped with a note.
    pub fn available() -> Vec<Engine> {
        ENGINES
            .into_iter()
            .filter(|engine| {
                let found = engine.program("server").is_file() || *engine == Engine::Redis;
                if !found {
                    assert!(
                        std::env::var("CI").as_deref() != Ok("true"),
                        "{} is not installed (VALKEY_BIN: {:?}); scripts/test.sh installs it",
                        engine.name(),
                        std::env::var_os("VALKEY_BIN")
                    );
                    eprintln!("{} is not installed: its rows are skipped", engine.name());
                }
                found
            })
            .collect()
    }

    /// `<engine>-server` or `<engine>-cli`.
    fn program(self, which: &str) -> PathBuf {
        match self {
            Engine::Redis => PathBuf::from(format!("redis-{which}")),
            Engine::Valkey => {
                let dir = std::env::var_os("VALKEY_BIN").unwrap_or_default();
                Path::new(&dir).join(format!("valkey-{which}"))
            }
        }
    }

    pub fn cli(self) -> Command {
        Command::new(self.program("cli"))
    }

    /// A standalone server.
    pub fn start(self) -> RedisServer {
        RedisServer::launch(self, Kind::Standalone, "")
    }

    /// A replica of `master`.
    pub fn start_replica(self, master: &RedisServer) -> RedisServer {
        RedisServer::launch(
            self,
            Kind::Standalone,
            &format!("replicaof 127.0.0.1 {}\n", master.port),
        )
    }

    /// A Sentinel monitoring `master` under `name`, with a quorum of `quorum` and short
    /// timeouts, so a failover starts a second after the master stops answering.
    pub fn start_sentinel(self, master: &RedisServer, name: &str, quorum: usize) -> RedisServer {
        RedisServer::launch(
            self,
            Kind::Sentinel {
                master_port: master.port,
                name: name.into(),
                quorum,
            },
            "",
        )
    }
}

/// What kind of process to start.
#[derive(Clone)]
enum Kind {
    Standalone,
    ClusterNode,
    Sentinel {
        master_port: u16,
        name: String,
        quorum: usize,
    },
}

pub struct RedisServer {
    engine: Engine,
    child: Option<Child>,
    port: u16,
    kind: Kind,
    /// Extra `redis.conf` lines; `{tls-port}` in them stands for [`RedisServer::tls_port`], so
    /// the nodes of one Cluster can share a configuration.
    extra: String,
    dir: tempfile::TempDir,
    /// Where a persistent server keeps its data, if elsewhere than `dir`.
    data: Option<tempfile::TempDir>,
}

impl RedisServer {
    /// A standalone server.
    pub fn start() -> RedisServer {
        Engine::Redis.start()
    }

    /// A standalone server with extra `redis.conf` lines.
    pub fn start_with(config: &str) -> RedisServer {
        RedisServer::launch(Engine::Redis, Kind::Standalone, config)
    }

    /// A standalone server that writes every change to its append-only file before answering
    /// (`appendfsync always`), kept in memory (`/dev/shm` where there is one) so that costs no
    /// disk latency: a SIGKILL loses nothing that was answered, and `restart` reloads it.
    pub fn start_persistent() -> RedisServer {
        let data = tempfile::Builder::new()
            .prefix("redis-data")
            .tempdir_in("/dev/shm")
            .or_else(|_| tempfile::tempdir())
            .expect("temporary directory");
        let config = format!(
            "appendonly yes\nappendfsync always\ndir {}\n",
            data.path().display()
        );
        let mut server = RedisServer::launch(Engine::Redis, Kind::Standalone, &config);
        server.data = Some(data);
        server
    }

    /// A replica of `master`.
    pub fn start_replica(master: &RedisServer) -> RedisServer {
        Engine::Redis.start_replica(master)
    }

    /// A Sentinel monitoring `master` under `name`, with a quorum of one, so it can fail over
    /// alone and quickly.
    pub fn start_sentinel(master: &RedisServer, name: &str) -> RedisServer {
        Engine::Redis.start_sentinel(master, name, 1)
    }

    fn launch(engine: Engine, kind: Kind, extra: &str) -> RedisServer {
        let mut last_log = String::new();
        // A free port can be taken by someone else before the server binds it: try again.
        for _ in 0..5 {
            let mut server = RedisServer {
                engine,
                child: None,
                port: free_port(),
                kind: kind.clone(),
                extra: extra.into(),
                dir: tempfile::tempdir().expect("temporary directory"),
                data: None,
            };
            if server.spawn() {
                return server;
            }
            last_log = server.log();
        }
        panic!(
            "{}-server did not start; its last log:\n{last_log}",
            engine.name()
        );
    }

    /// Start the process and wait until it answers; false if it died or stayed silent.
    fn spawn(&mut self) -> bool {
        let dir = self.dir.path();
        let mut config = format!(
            "port {}\nbind 127.0.0.1\nsave \"\"\nappendonly no\ndir {}\nlogfile {}\n",
            self.port,
            dir.display(),
            dir.join("redis.log").display()
        );
        // As the README asks of a Redis in production: bounded, making room from keys with a
        // TTL (all of turnstile's). A test's own lines come after, and win.
        if !matches!(self.kind, Kind::Sentinel { .. }) {
            config.push_str("maxmemory 256mb\nmaxmemory-policy volatile-lru\n");
        }
        match &self.kind {
            Kind::Standalone => {}
            // The bus port explicitly: with `tls-cluster` it would follow the TLS port.
            Kind::ClusterNode => config.push_str(&format!(
                "cluster-enabled yes\ncluster-config-file {}\ncluster-node-timeout 5000\ncluster-port {}\n",
                dir.join("nodes.conf").display(),
                self.port + 10_000
            )),
            Kind::Sentinel {
                master_port,
                name,
                quorum,
            } => config.push_str(&format!(
                "sentinel monitor {name} 127.0.0.1 {master_port} {quorum}\n\
                 sentinel down-after-milliseconds {name} 1000\n\
                 sentinel failover-timeout {name} 5000\n"
            )),
        }
        config.push_str(
            &self
                .extra
                .replace("{tls-port}", &self.tls_port().to_string()),
        );
        let path = dir.join("redis.conf");
        fs::write(&path, config).expect("write redis.conf");
        let mut command = Command::new(self.engine.program("server"));
        command.arg(&path);
        if matches!(self.kind, Kind::Sentinel { .. }) {
            command.arg("--sentinel");
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|err| panic!("{}-server must be installed: {err}", self.engine.name()));
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(child) = &mut self.child
                && let Ok(Some(_)) = child.try_wait()
            {
                self.child = None;
                return false;
            }
            if self.answers() {
                return true;
            }
            sleep(POLL);
        }
        self.stop();
        false
    }

    /// Whether the server answers PING; a refusal (NOAUTH, LOADING) is an answer too.
    pub fn answers(&self) -> bool {
        match self.try_query::<String>(&["PING"]) {
            Ok(_) => true,
            Err(err) => err.code().is_some(),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// The TLS port, if the configuration opened one with `tls-port {tls-port}`.
    pub fn tls_port(&self) -> u16 {
        self.port + TLS_PORT_OFFSET
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kill the process (SIGKILL, by PID) and reap it. The files stay for `restart`.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stop, then start again on the same port with the same configuration.
    pub fn restart(&mut self) {
        self.stop();
        assert!(
            self.spawn(),
            "redis-server did not restart:\n{}",
            self.log()
        );
    }

    /// Suspend the process (SIGSTOP): it keeps its connections and answers nothing.
    pub fn freeze(&self) {
        signal(self.pid().expect("the server is not running"), "STOP");
    }

    /// Resume a frozen process (SIGCONT).
    pub fn thaw(&self) {
        signal(self.pid().expect("the server is not running"), "CONT");
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }

    /// A fresh synchronous connection, with short timeouts.
    pub fn connection(&self) -> redis::RedisResult<redis::Connection> {
        let client = redis::Client::open(self.url())?;
        let connection = client.get_connection_with_timeout(Duration::from_secs(2))?;
        connection.set_read_timeout(Some(Duration::from_secs(5)))?;
        Ok(connection)
    }

    /// Run one command, e.g. `server.query::<i64>(&["DBSIZE"])`; panics on error.
    pub fn query<T: FromRedisValue>(&self, args: &[&str]) -> T {
        self.try_query(args)
            .unwrap_or_else(|err| panic!("{} on {}: {err}", args.join(" "), self.addr()))
    }

    pub fn try_query<T: FromRedisValue>(&self, args: &[&str]) -> redis::RedisResult<T> {
        let mut command = redis::Cmd::new();
        for arg in args {
            command.arg(arg);
        }
        command.query(&mut self.connection()?)
    }

    /// How many script calls (`FCALL`, `EVALSHA` and `EVAL`) the server has run.
    pub fn script_calls(&self) -> u64 {
        self.calls(&["fcall", "evalsha", "eval"])
    }

    /// How many calls of these commands (lower case, as `INFO commandstats` names them) the
    /// server has run.
    pub fn calls(&self, commands: &[&str]) -> u64 {
        let info: String = self.query(&["INFO", "commandstats"]);
        commands
            .iter()
            .filter_map(|cmd| {
                let line = info
                    .lines()
                    .find(|l| l.starts_with(&format!("cmdstat_{cmd}:")))?;
                line.split(['=', ','])
                    .nth(1)
                    .and_then(|calls| calls.parse::<u64>().ok())
            })
            .sum()
    }

    /// The server's clients, oldest first: each one's id and last command (lower case, as
    /// `CLIENT LIST` names it), less the connection that asks.
    pub fn clients(&self) -> Vec<(u64, String)> {
        let list: String = self.query(&["CLIENT", "LIST"]);
        let mut clients: Vec<(u64, String)> = list
            .lines()
            .filter_map(|line| {
                let field = |name: &str| {
                    line.split(' ')
                        .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
                };
                let cmd = field("cmd")?;
                (cmd != "client|list").then(|| Some((field("id")?.parse().ok()?, cmd.into())))?
            })
            .collect();
        clients.sort();
        clients
    }

    /// Bytes clients have sent that the server has not read yet: the receive queues of its
    /// connections (/proc/net/tcp). While the server is frozen, more than 0 means a call
    /// was written to it.
    pub fn unread_bytes(&self) -> u64 {
        let port = format!(":{:04X}", self.port());
        let table = fs::read_to_string("/proc/net/tcp").expect("read /proc/net/tcp");
        table
            .lines()
            .skip(1)
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                // local address, remote address, state, "tx_queue:rx_queue"
                let (local, state, queues) = (fields.get(1)?, fields.get(3)?, fields.get(4)?);
                // Connections only (01: ESTABLISHED, 08: closed by the client, data still
                // to read), not the listening socket's backlog.
                if !local.ends_with(&port) || !["01", "08"].contains(state) {
                    return None;
                }
                u64::from_str_radix(queues.split(':').nth(1)?, 16).ok()
            })
            .sum()
    }

    /// Wait (polling, at most 5 s) until a call has been written to this frozen server.
    pub async fn written_to(&self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.unread_bytes() == 0 {
            assert!(Instant::now() < deadline, "never written to Redis: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The first element of `ROLE`: "master", "slave" or "sentinel"; None if it does not answer.
    pub fn role(&self) -> Option<String> {
        let reply: redis::Value = self.try_query(&["ROLE"]).ok()?;
        match reply {
            redis::Value::Array(items) => items
                .first()
                .and_then(|v| String::from_redis_value_ref(v).ok()),
            _ => None,
        }
    }

    /// One field of `INFO <section>`, e.g. `info("replication", "master_repl_offset")`.
    pub fn info(&self, section: &str, field: &str) -> Option<String> {
        let text: String = self.try_query(&["INFO", section]).ok()?;
        let prefix = format!("{field}:");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .map(|v| v.trim().to_owned())
    }

    /// Every key matching `pattern`, by SCAN.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let mut connection = self.connection().expect("connect");
        let mut keys: Vec<String> = redis::cmd("SCAN")
            .cursor_arg(0)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .clone()
            .iter(&mut connection)
            .expect("SCAN")
            .map(|k| k.expect("key"))
            .collect();
        keys.sort();
        keys
    }

    /// Wait until `done` holds for this server, or panic after `timeout` with `what`.
    pub fn wait_until(&self, timeout: Duration, what: &str, done: impl Fn(&RedisServer) -> bool) {
        let deadline = Instant::now() + timeout;
        while !done(self) {
            assert!(
                Instant::now() < deadline,
                "{what}: not within {timeout:?} on {}",
                self.addr()
            );
            sleep(POLL);
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A port nobody listens on, nor on the Cluster bus port (+10000) or the TLS port next to it.
fn free_port() -> u16 {
    let bindable = |port: u16| TcpListener::bind(("127.0.0.1", port)).is_ok();
    for _ in 0..1000 {
        let port = fastrand::u16(20_000..45_000);
        if [0, 10_000, TLS_PORT_OFFSET]
            .iter()
            .all(|offset| bindable(port + offset))
        {
            return port;
        }
    }
    panic!("no free port found");
}

/// A Cluster of masters (optionally each with replicas), slots spread evenly by
/// `redis-cli --cluster create`.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Masters without replicas.
    pub fn start(masters: usize) -> RedisCluster {
        RedisCluster::start_with(masters, 0, "")
    }

    /// `masters` masters with `replicas` replicas each, every node with the extra `redis.conf`
    /// lines `config` (e.g. a short `cluster-node-timeout`, so a replica takes over quickly).
    /// Returns once every node sees the whole Cluster healthy and every replica is in sync.
    pub fn start_with(masters: usize, replicas: usize, config: &str) -> RedisCluster {
        RedisCluster::start_on(Engine::Redis, masters, replicas, config)
    }

    /// As `start_with`, on `engine`.
    pub fn start_on(engine: Engine, masters: usize, replicas: usize, config: &str) -> RedisCluster {
        let total = masters * (1 + replicas);
        let nodes: Vec<RedisServer> = (0..total)
            .map(|_| RedisServer::launch(engine, Kind::ClusterNode, config))
            .collect();
        let mut create = engine.cli();
        create.arg("--cluster").arg("create");
        create.args(nodes.iter().map(RedisServer::addr));
        if replicas > 0 {
            create.arg("--cluster-replicas").arg(replicas.to_string());
        }
        create.arg("--cluster-yes");
        let log = nodes[0].dir.path().join("create.log");
        let out = fs::File::create(&log).expect("create.log");
        let mut child = create
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("dup"))
            .stderr(out)
            .spawn()
            .unwrap_or_else(|err| panic!("{}-cli must be installed: {err}", engine.name()));
        let deadline = Instant::now() + CLUSTER_TIMEOUT;
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for redis-cli") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("redis-cli --cluster create hung:\n{}", read(&log));
            }
            sleep(POLL);
        };
        assert!(
            status.success(),
            "redis-cli --cluster create failed:\n{}",
            read(&log)
        );
        let cluster = RedisCluster { nodes };
        let known = format!("cluster_known_nodes:{total}");
        for node in &cluster.nodes {
            node.wait_until(CLUSTER_TIMEOUT, "cluster_state:ok", |n| {
                n.try_query::<String>(&["CLUSTER", "INFO"])
                    .is_ok_and(|info| info.contains("cluster_state:ok") && info.contains(&known))
            });
        }
        for node in &cluster.nodes {
            node.wait_until(CLUSTER_TIMEOUT, "replica in sync", |n| {
                n.role().as_deref() != Some("slave")
                    || n.info("replication", "master_link_status").as_deref() == Some("up")
            });
        }
        cluster
    }

    /// The running nodes that are masters now.
    pub fn masters(&self) -> Vec<&RedisServer> {
        self.nodes
            .iter()
            .filter(|n| n.pid().is_some() && n.role().as_deref() == Some("master"))
            .collect()
    }

    /// The running replicas of the master listening on `master_port`.
    pub fn replicas_of(&self, master_port: u16) -> Vec<&RedisServer> {
        let port = master_port.to_string();
        self.nodes
            .iter()
            .filter(|n| n.pid().is_some() && n.role().as_deref() == Some("slave"))
            .filter(|n| n.info("replication", "master_port").as_deref() == Some(port.as_str()))
            .collect()
    }

    /// One Cluster shared by the tests that run at the same time; stopped when the last of
    /// them drops it (a static would never be dropped, and would leak the processes).
    pub fn shared() -> Arc<RedisCluster> {
        static SHARED: Mutex<Weak<RedisCluster>> = Mutex::new(Weak::new());
        let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(cluster) = shared.upgrade() {
            return cluster;
        }
        let cluster = Arc::new(RedisCluster::start(3));
        *shared = Arc::downgrade(&cluster);
        cluster
    }

    /// The nodes' URLs, as seeds.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The node that owns `slot`.
    pub fn owner(&self, slot: u16) -> &RedisServer {
        let slots: Vec<redis::Value> = self.nodes[0].query(&["CLUSTER", "SLOTS"]);
        for range in slots {
            let redis::Value::Array(range) = range else {
                continue;
            };
            let (Ok(start), Ok(end)) = (
                i64::from_redis_value_ref(&range[0]),
                i64::from_redis_value_ref(&range[1]),
            ) else {
                continue;
            };
            let redis::Value::Array(master) = &range[2] else {
                continue;
            };
            let port = i64::from_redis_value_ref(&master[1]).expect("port");
            if (start..=end).contains(&i64::from(slot)) {
                return self
                    .nodes
                    .iter()
                    .find(|n| i64::from(n.port) == port)
                    .expect("a node of ours");
            }
        }
        panic!("no node owns slot {slot}");
    }

    /// Every key matching `pattern` on any node.
    pub fn keys(&self, pattern: &str) -> Vec<(String, &RedisServer)> {
        self.nodes
            .iter()
            .flat_map(|n| n.keys(pattern).into_iter().map(move |k| (k, n)))
            .collect()
    }
}

fn read(path: &PathBuf) -> String {
    fs::read_to_string(path).unwrap_or_default()
}

/// A master with one replica, watched by three Sentinels (quorum two) that fail it over a
/// second after it stops answering.
pub struct SentinelGroup {
    pub name: String,
    pub master: RedisServer,
    pub replica: RedisServer,
    pub sentinels: Vec<RedisServer>,
}

impl SentinelGroup {
    /// Returns once the replica is in sync and every Sentinel knows it and the other
    /// Sentinels (so that a failover can start at once).
    pub fn start(engine: Engine, name: &str) -> SentinelGroup {
        let master = engine.start();
        let replica = engine.start_replica(&master);
        replica.wait_until(START_TIMEOUT, "replica in sync", |r| {
            r.info("replication", "master_link_status").as_deref() == Some("up")
        });
        let sentinels: Vec<RedisServer> = (0..3)
            .map(|_| engine.start_sentinel(&master, name, 2))
            .collect();
        for sentinel in &sentinels {
            sentinel.wait_until(CLUSTER_TIMEOUT, "sentinel knows its peers", |s| {
                let known = |what: &str| {
                    s.try_query::<Vec<redis::Value>>(&["SENTINEL", what, name])
                        .map_or(0, |v| v.len())
                };
                known("REPLICAS") == 1 && known("SENTINELS") == 2
            });
        }
        SentinelGroup {
            name: name.into(),
            master,
            replica,
            sentinels,
        }
    }

    /// turnstile's `--redis-url` for this group: the master's name, then the Sentinels.
    pub fn redis_url(&self) -> String {
        let mut parts = vec![self.name.clone()];
        parts.extend(self.sentinels.iter().map(RedisServer::addr));
        parts.join(",")
    }
}

/// When a Sentinel announced `+switch-master`, heard on a subscription of its own (a thread
/// that ends when this is dropped).
pub struct Announcements {
    heard: Arc<Mutex<Option<Instant>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Announcements {
    /// Subscribe now (returns once subscribed).
    pub fn listen(sentinel: &RedisServer) -> Announcements {
        use std::sync::atomic::{AtomicBool, Ordering};
        let heard = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let mut connection = sentinel.connection().expect("connect to the sentinel");
        connection
            .set_read_timeout(Some(Duration::from_millis(100)))
            .expect("read timeout");
        let (subscribed_tx, subscribed) = std::sync::mpsc::channel();
        let thread = {
            let (heard, stop) = (heard.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut pubsub = connection.as_pubsub();
                pubsub.subscribe("+switch-master").expect("subscribe");
                let _ = subscribed_tx.send(());
                while !stop.load(Ordering::Relaxed) {
                    if pubsub.get_message().is_ok() {
                        let at = Instant::now();
                        heard.lock().unwrap().get_or_insert(at);
                    }
                }
            })
        };
        subscribed
            .recv_timeout(START_TIMEOUT)
            .expect("subscribed to +switch-master");
        Announcements {
            heard,
            stop,
            thread: Some(thread),
        }
    }

    /// When the first `+switch-master` was heard, waiting for it at most `timeout`.
    pub fn first(&self, timeout: Duration) -> Option<Instant> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(at) = *self.heard.lock().unwrap() {
                return Some(at);
            }
            if Instant::now() > deadline {
                return None;
            }
            sleep(POLL);
        }
    }
}

impl Drop for Announcements {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
