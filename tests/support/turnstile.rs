//! Runs the real `turnstile` binary on free loopback ports and talks to it over gRPC and
//! HTTP. The process is killed (by PID) when the handle drops.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::Channel;

const START_TIMEOUT: Duration = Duration::from_secs(15);

/// The only variables turnstile inherits from the test's environment. Nearly every setting
/// has an environment variable (REDIS_URL, SHADOW_MODE, CACHE_KEY_PREFIX ...): one set on a
/// developer's shell or a CI runner would silently change what a test tests, so each test
/// passes its settings explicitly.
pub const INHERITED_ENV: &[&str] = &["PATH", "HOME", "TMPDIR", "RUST_BACKTRACE"];

/// Raise this process's open-files soft limit to its hard one (as turnstile does for
/// itself), for a test that opens `needed` sockets at once; fails when even the hard limit
/// is lower.
pub fn raise_open_files_limit(needed: usize) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed to them.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        limit.rlim_cur = limit.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
    }
    assert!(
        limit.rlim_cur == libc::RLIM_INFINITY || limit.rlim_cur as usize >= needed,
        "this test opens {needed} sockets, over the open-files hard limit {}",
        limit.rlim_cur
    );
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A directory holding rule files.
pub struct Rules {
    pub dir: tempfile::TempDir,
}

impl Rules {
    /// One file `rules.yaml` with `yaml`.
    pub fn new(yaml: &str) -> Rules {
        let rules = Rules {
            dir: tempfile::tempdir().expect("temp dir"),
        };
        rules.write("rules.yaml", yaml);
        rules
    }

    pub fn write(&self, name: &str, yaml: &str) {
        std::fs::write(self.dir.path().join(name), yaml).expect("write rules");
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// Rules for `domain` whose descriptors nest `depth` levels deep (each level a list and a
/// map), written in block style as a person would.
pub fn nested_rules(domain: &str, depth: usize) -> String {
    let mut yaml = format!("domain: {domain}\ndescriptors:\n");
    for level in 0..depth {
        let indent = "  ".repeat(level);
        yaml.push_str(&format!(
            "{indent}- key: k{level}\n{indent}  descriptors:\n"
        ));
    }
    yaml.push_str(&format!(
        "{}- key: last\n{0}  rate_limit: {{unit: hour, requests_per_unit: 1}}\n",
        "  ".repeat(depth)
    ));
    yaml
}

pub struct Turnstile {
    child: Child,
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// A command the binary runs under, e.g. `prlimit --nofile=64 --`.
    launcher: Vec<String>,
}

impl Turnstile {
    /// Start with rules from `config` on the memory backend (unless `extra` says otherwise)
    /// and wait until healthy.
    pub async fn start(config: &Path, extra: &[&str]) -> Turnstile {
        let mut args = vec!["--config", config.to_str().expect("UTF-8 path")];
        args.extend_from_slice(extra);
        Turnstile::start_with(&args, &[]).await
    }

    /// Start with exactly these `serve` arguments (plus listen addresses) and environment.
    pub async fn start_with(args: &[&str], env: &[(&str, &str)]) -> Turnstile {
        Turnstile::start_under(&[], args, env).await
    }

    /// As `start_with`, the binary run by `launcher` (which must exec it, keeping its PID).
    pub async fn start_under(launcher: &[&str], args: &[&str], env: &[(&str, &str)]) -> Turnstile {
        Turnstile::launch(launcher, args, env, true).await
    }

    /// As `start_with`, but wait only until the admin port answers, healthy or not (an
    /// instance whose backend is not reachable yet).
    pub async fn start_unhealthy(args: &[&str], env: &[(&str, &str)]) -> Turnstile {
        Turnstile::launch(&[], args, env, false).await
    }

    async fn launch(
        launcher: &[&str],
        args: &[&str],
        env: &[(&str, &str)],
        healthy: bool,
    ) -> Turnstile {
        let launcher: Vec<String> = launcher.iter().map(|s| s.to_string()).collect();
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        // A free port can be taken by another process before turnstile binds it: then it
        // exits at once, and starts again on other ports.
        let mut exits = Vec::new();
        for _ in 0..5 {
            let grpc = SocketAddr::from(([127, 0, 0, 1], free_port()));
            let http = SocketAddr::from(([127, 0, 0, 1], free_port()));
            let mut t = Turnstile {
                child: spawn(grpc, http, &args, &env, &launcher),
                grpc,
                http,
                args: args.clone(),
                env: env.clone(),
                launcher: launcher.clone(),
            };
            match t.wait_answering(healthy).await {
                Ok(()) => return t,
                Err(status) => exits.push(status),
            }
        }
        panic!("turnstile exited during start-up, every time: {exits:?}");
    }

    /// Start several at once (each waits for its own health), in the order of `extras`.
    pub async fn start_all(config: &Path, extras: &[Vec<String>]) -> Vec<Turnstile> {
        let mut tasks = tokio::task::JoinSet::new();
        for (i, extra) in extras.iter().enumerate() {
            let (config, extra) = (config.to_owned(), extra.clone());
            tasks.spawn(async move {
                let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
                (i, Turnstile::start(&config, &extra).await)
            });
        }
        let mut started: Vec<Option<Turnstile>> = extras.iter().map(|_| None).collect();
        while let Some(joined) = tasks.join_next().await {
            let (i, t) = joined.expect("a turnstile start-up task panicked");
            started[i] = Some(t);
        }
        started.into_iter().map(|t| t.expect("started")).collect()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process still runs (it has not exited, crashed or panicked out).
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The value of one Prometheus sample, e.g.
    /// `metric("turnstile_backend_circuit_transitions{state=\"open\"}")`; None if absent.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        let (status, body) = self.http_get("/metrics").await.ok()?;
        assert_eq!(status, 200, "/metrics answered {status}");
        body.lines().find_map(|line| {
            let value = line.strip_prefix(series)?.strip_prefix(' ')?;
            value.trim().parse().ok()
        })
    }

    /// Wait until `/healthcheck` answers (200 if `healthy`); the exit status if the process
    /// ended first.
    async fn wait_answering(&mut self, healthy: bool) -> Result<(), ExitStatus> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(status);
            }
            if let Ok((status, _)) = self.http_get("/healthcheck").await
                && (status == 200 || !healthy)
            {
                return Ok(());
            }
            assert!(Instant::now() < deadline, "turnstile not healthy in time");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL and start again on the same ports, with the same arguments.
    pub async fn kill_and_restart(&mut self) {
        self.kill();
        self.child = spawn(self.grpc, self.http, &self.args, &self.env, &self.launcher);
        if let Err(status) = self.wait_answering(true).await {
            panic!("turnstile exited during its restart: {status}");
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then wait (bounded) for the exit status.
    pub async fn terminate(&mut self) -> ExitStatus {
        signal(self.pid(), "TERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "turnstile did not stop on SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("gRPC connect")
    }

    pub async fn channel(&self) -> Channel {
        turnstile_bench::channel(&self.grpc.to_string())
            .await
            .expect("gRPC connect")
    }

    /// One ShouldRateLimit call on a fresh connection.
    pub async fn call(
        &self,
        request: RateLimitRequest,
    ) -> Result<RateLimitResponse, tonic::Status> {
        self.client()
            .await
            .should_rate_limit(request)
            .await
            .map(tonic::Response::into_inner)
    }

    pub async fn http_get(&self, path: &str) -> std::io::Result<(u16, String)> {
        http(self.http, "GET", path, "").await
    }

    pub async fn http_post(&self, path: &str, body: &str) -> std::io::Result<(u16, String)> {
        http(self.http, "POST", path, body).await
    }
}

impl Drop for Turnstile {
    fn drop(&mut self) {
        self.kill();
    }
}

fn spawn(
    grpc: SocketAddr,
    http: SocketAddr,
    args: &[String],
    env: &[(String, String)],
    launcher: &[String],
) -> Child {
    let binary = env!("CARGO_BIN_EXE_turnstile");
    let mut command = match launcher.split_first() {
        Some((program, launcher_args)) => {
            let mut command = Command::new(program);
            command.args(launcher_args).arg(binary);
            command
        }
        None => Command::new(binary),
    };
    command
        .arg("serve")
        .arg("--grpc-addr")
        .arg(grpc.to_string())
        .arg("--http-addr")
        .arg(http.to_string());
    // The debug port defaults to 6070 on every interface: tests keep it on loopback, on a
    // port of its own.
    if !args.iter().any(|a| a == "--debug-addr") {
        command.args(["--debug-addr", "127.0.0.1:0"]);
    }
    command
        .args(args)
        .env_clear()
        .envs(
            INHERITED_ENV
                .iter()
                .filter_map(|k| Some((k, std::env::var_os(k)?))),
        )
        .env("LOG_LEVEL", "warn")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn turnstile")
}

pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {pid}");
}

/// A minimal HTTP/1.1 exchange (one request per connection), enough for admin endpoints.
pub async fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<(u16, String)> {
    exchange(
        addr,
        format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    )
    .await
}

/// A GET in HTTP/1.0, whose answer a server cannot chunk (Go servers, such as Prometheus,
/// chunk a long answer to HTTP/1.1 even on a connection that closes after it).
pub async fn http10_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    exchange(addr, format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")).await
}

/// Send `request`, read the answer to the end: its status and body.
async fn exchange(addr: SocketAddr, request: String) -> std::io::Result<(u16, String)> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        let text = String::from_utf8_lossy(&response).into_owned();
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .unwrap_or_else(|_| Err(std::io::Error::other("HTTP timeout")))
}

// Requests are built as the load generator builds them.
pub use turnstile_bench::{descriptor, request};
