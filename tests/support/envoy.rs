//! A real Envoy for end-to-end tests: the shipped example bootstraps with only their addresses
//! rewritten to free loopback ports, an HTTP/1.1 client that can pick its source address (the
//! examples limit per client address), and an upstream that answers every path, holding
//! `/hold*` requests until released (requests in flight, for the concurrency example).
//! Every process is killed by PID when its handle drops; every wait is bounded.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use super::turnstile::{free_port, http};

const START_TIMEOUT: Duration = Duration::from_secs(30);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The text of a shipped example, `examples/envoy/<name>`.
pub fn example_text(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/envoy")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Where an example's processes listen: what the shipped file says (the docker-compose
/// service names), and where the test puts them.
struct Addresses {
    pub admin: SocketAddr,
    pub listener: SocketAddr,
    pub turnstiles: [SocketAddr; 2],
    pub upstream: SocketAddr,
}

/// `yaml` with every address of the example replaced; each must be there exactly once, so a
/// changed example fails here rather than silently keeping an address of its own.
fn rewrite(yaml: &str, at: &Addresses) -> String {
    let socket = |a: SocketAddr| format!("{{address: {}, port_value: {}}}", a.ip(), a.port());
    let replacements = [
        ("{address: 0.0.0.0, port_value: 9901}", socket(at.admin)),
        ("{address: 0.0.0.0, port_value: 10000}", socket(at.listener)),
        (
            "{address: turnstile-1, port_value: 8081}",
            socket(at.turnstiles[0]),
        ),
        (
            "{address: turnstile-2, port_value: 8081}",
            socket(at.turnstiles[1]),
        ),
        ("{address: upstream, port_value: 8080}", socket(at.upstream)),
    ];
    let mut out = yaml.to_owned();
    for (from, to) in replacements {
        assert_eq!(out.matches(from).count(), 1, "`{from}` in the example");
        out = out.replace(from, &to);
    }
    out
}

pub struct Envoy {
    child: Child,
    pub admin: SocketAddr,
    pub listener: SocketAddr,
    dir: tempfile::TempDir,
}

impl Envoy {
    /// Envoy with the example `name`, its turnstile cluster pointed at `turnstiles` and its
    /// upstream at `upstream`; returns once both turnstile hosts pass their health check.
    pub async fn start(
        binary: &Path,
        name: &str,
        turnstiles: [SocketAddr; 2],
        upstream: SocketAddr,
    ) -> Envoy {
        Envoy::start_yaml(binary, &example_text(name), turnstiles, upstream).await
    }

    /// As `start`, with an example's text the test changed (`example_text`).
    pub async fn start_yaml(
        binary: &Path,
        yaml: &str,
        turnstiles: [SocketAddr; 2],
        upstream: SocketAddr,
    ) -> Envoy {
        let mut failures = Vec::new();
        // A free port can be taken by someone else before Envoy binds it: try again.
        for _ in 0..3 {
            let at = Addresses {
                admin: loopback(free_port()),
                listener: loopback(free_port()),
                turnstiles,
                upstream,
            };
            let dir = tempfile::tempdir().expect("temp dir");
            let config = dir.path().join("envoy.yaml");
            std::fs::write(&config, rewrite(yaml, &at)).expect("write envoy.yaml");
            let log = std::fs::File::create(dir.path().join("envoy.log")).expect("log");
            let child = Command::new(binary)
                .arg("-c")
                .arg(&config)
                // Several Envoys at once: no shared memory between them, one worker each.
                .args(["--disable-hot-restart", "--concurrency", "1"])
                .args(["-l", "warning"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("spawn envoy");
            let mut envoy = Envoy {
                child,
                admin: at.admin,
                listener: at.listener,
                dir,
            };
            if envoy.wait_ready().await {
                envoy.wait_healthy_hosts(2).await;
                return envoy;
            }
            failures.push(envoy.log());
        }
        panic!("Envoy did not start, three times; its logs:\n{failures:#?}");
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }

    /// Until the admin's /ready answers 200; false if the process exited first.
    async fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if let Ok((200, _)) = http(self.admin, "GET", "/ready", "").await {
                return true;
            }
            assert!(
                Instant::now() < deadline,
                "Envoy not ready in time:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The turnstile cluster's hosts that pass their health check.
    pub async fn healthy_hosts(&self) -> usize {
        let (_, body) = http(self.admin, "GET", "/clusters", "")
            .await
            .unwrap_or_default();
        body.lines()
            .filter(|l| l.starts_with("turnstile::") && l.ends_with("::health_flags::healthy"))
            .count()
    }

    /// Until exactly `n` turnstile hosts are healthy (bounded).
    pub async fn wait_healthy_hosts(&self, n: usize) {
        let deadline = Instant::now() + START_TIMEOUT;
        while self.healthy_hosts().await != n {
            assert!(
                Instant::now() < deadline,
                "Envoy never saw {n} healthy turnstile hosts:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Envoy's counters whose names contain `filter` (`/stats?filter=`), by name.
    pub async fn stats(&self, filter: &str) -> BTreeMap<String, u64> {
        let (status, body) = http(self.admin, "GET", &format!("/stats?filter={filter}"), "")
            .await
            .expect("Envoy admin /stats");
        assert_eq!(status, 200, "/stats: {body}");
        body.lines()
            .filter_map(|l| {
                let (name, value) = l.split_once(": ")?;
                Some((name.to_owned(), value.trim().parse().ok()?))
            })
            .collect()
    }

    /// One request through the listener from `source` (a loopback address: each its own
    /// client for `remote_address` descriptors).
    pub async fn get(&self, source: Ipv4Addr, path: &str, headers: &[(&str, &str)]) -> Reply {
        get(self.listener, source, path, headers).await
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// An HTTP answer as the client saw it.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    /// Lower-case names.
    pub headers: Vec<(String, String)>,
    pub elapsed: Duration,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The request's head as bytes.
fn request_head(path: &str, headers: &[(&str, &str)]) -> Vec<u8> {
    let mut head = format!("GET {path} HTTP/1.1\r\nHost: turnstile.test\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("Connection: close\r\n\r\n");
    head.into_bytes()
}

/// A connection from `source` to `to`.
async fn connect(source: Ipv4Addr, to: SocketAddr) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::new(IpAddr::V4(source), 0))
        .expect("bind a loopback source address");
    socket.connect(to).await.expect("connect to Envoy")
}

/// Sends a request on a new connection and leaves it open (to reset it, or read later).
pub async fn send(
    to: SocketAddr,
    source: Ipv4Addr,
    path: &str,
    headers: &[(&str, &str)],
) -> tokio::net::TcpStream {
    let mut stream = connect(source, to).await;
    stream
        .write_all(&request_head(path, headers))
        .await
        .expect("send the request");
    stream
}

/// Reads one answer to its end (the request asked to close the connection).
pub async fn read_reply(mut stream: tokio::net::TcpStream, started: Instant) -> Reply {
    let mut raw = Vec::new();
    tokio::time::timeout(REQUEST_TIMEOUT, stream.read_to_end(&mut raw))
        .await
        .expect("Envoy answered in time")
        .expect("read the answer");
    let text = String::from_utf8_lossy(&raw);
    let head = text.split("\r\n\r\n").next().unwrap_or_default();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Reply {
        status,
        headers,
        elapsed: started.elapsed(),
    }
}

pub async fn get(to: SocketAddr, source: Ipv4Addr, path: &str, headers: &[(&str, &str)]) -> Reply {
    let started = Instant::now();
    let stream = send(to, source, path, headers).await;
    read_reply(stream, started).await
}

/// Closes `stream` with a TCP reset (SO_LINGER 0): the client gives up on its request.
pub fn reset(stream: tokio::net::TcpStream) {
    #[allow(deprecated)] // blocking on drop is the point: the reset is sent at once
    stream.set_linger(Some(Duration::ZERO)).expect("SO_LINGER");
    drop(stream);
}

/// An HTTP/1.1 upstream on its own thread: 200 "hello from upstream" for every path, except
/// that `/hold*` waits until `release` (or until Envoy drops the connection).
pub struct Upstream {
    pub addr: SocketAddr,
    held: Arc<AtomicUsize>,
    release: Arc<watch::Sender<u64>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Upstream {
    pub fn start() -> Upstream {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind upstream");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("address");
        let held = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(watch::channel(0u64).0);
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let (h, r) = (held.clone(), release.clone());
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                let accept = async {
                    while let Ok((stream, _)) = listener.accept().await {
                        tokio::spawn(serve(stream, h.clone(), r.subscribe()));
                    }
                };
                tokio::select! {
                    _ = accept => {}
                    _ = stopped => {}
                }
            });
        });
        Upstream {
            addr,
            held,
            release,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Requests waiting at `/hold` now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// Until exactly `n` requests are held (bounded).
    pub async fn wait_held(&self, n: usize) {
        let deadline = Instant::now() + REQUEST_TIMEOUT;
        while self.held() != n {
            assert!(
                Instant::now() < deadline,
                "{} held, waited for {n}",
                self.held()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Answers every held request.
    pub fn release(&self) {
        self.release.send_modify(|generation| *generation += 1);
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One upstream connection: requests one after another (Envoy keeps connections alive).
async fn serve(
    mut stream: tokio::net::TcpStream,
    held: Arc<AtomicUsize>,
    mut release: watch::Receiver<u64>,
) {
    const BODY: &str = "hello from upstream\n";
    let mut buffer = Vec::new();
    loop {
        let head_end = loop {
            if let Some(i) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buffer[..head_end]).into_owned();
        buffer.drain(..head_end);
        let path = head.split(' ').nth(1).unwrap_or("/");
        if path.starts_with("/hold") {
            release.mark_unchanged();
            held.fetch_add(1, Ordering::SeqCst);
            let mut probe = [0u8; 1];
            let released = tokio::select! {
                _ = release.changed() => true,
                // Envoy closed the connection: the client went away.
                _ = stream.read(&mut probe) => false,
            };
            held.fetch_sub(1, Ordering::SeqCst);
            if !released {
                return;
            }
        }
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{BODY}",
            BODY.len()
        );
        if stream.write_all(answer.as_bytes()).await.is_err() {
            return;
        }
    }
}
