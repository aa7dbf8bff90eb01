//! Rules from a control plane: a real ADS server (tonic, envoy-types' discovery protos) in this
//! process pushes `RateLimitConfig` resources to the real binary, and every effect is checked
//! through ShouldRateLimit, /rlconfig and /healthcheck, and in the ACKs and NACKs it sends back.

mod support;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::google::protobuf::{Any, UInt64Value};
use futures_util::Stream;
use prost::Message;
use support::clock::{HOUR, clear_of_end};
use support::redis::RedisServer;
use support::turnstile::{Turnstile, descriptor, request, signal};
use tokio::sync::{mpsc, watch};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};
use turnstile::config::xds::TYPE_URL;
use turnstile::config::xds::pb::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};

const WAIT: Duration = Duration::from_secs(10);

/// What the control plane serves: a version and its resources (None: nothing yet).
type Snapshot = Option<(String, Vec<Any>)>;

/// An ADS server holding one snapshot for every client, recording every request it gets.
#[derive(Clone)]
struct ControlPlane {
    snapshot: Arc<watch::Sender<Snapshot>>,
    requests: Arc<Mutex<Vec<DiscoveryRequest>>>,
    /// The headers each stream was opened with.
    headers: Arc<Mutex<Vec<tonic::metadata::MetadataMap>>>,
    /// Fires when the server serving this stream stops: its streams end with it.
    stopped: watch::Receiver<bool>,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for ControlPlane {
    type StreamAggregatedResourcesStream = ResponseStream;
    type DeltaAggregatedResourcesStream =
        Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<ResponseStream>, Status> {
        self.headers
            .lock()
            .unwrap()
            .push(request.metadata().clone());
        let mut inbound = request.into_inner();
        let mut snapshots = self.snapshot.subscribe();
        snapshots.mark_changed();
        let requests = self.requests.clone();
        let mut stopped = self.stopped.clone();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let mut nonce = 0u64;
            loop {
                tokio::select! {
                    () = async { let _ = stopped.wait_for(|s| *s).await; } => return,
                    message = inbound.message() => match message {
                        Ok(Some(r)) => requests.lock().unwrap().push(r),
                        _ => return,
                    },
                    changed = snapshots.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        let Some((version, resources)) = snapshots.borrow_and_update().clone() else {
                            continue;
                        };
                        nonce += 1;
                        let response = DiscoveryResponse {
                            version_info: version,
                            resources,
                            type_url: TYPE_URL.into(),
                            nonce: nonce.to_string(),
                            ..Default::default()
                        };
                        if tx.send(Ok(response)).await.is_err() {
                            return;
                        }
                    }
                }
            }
        });
        let outbound = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        Ok(Response::new(Box::pin(outbound)))
    }

    async fn delta_aggregated_resources(
        &self,
        _: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        Err(Status::unimplemented("SotW only"))
    }
}

impl ControlPlane {
    fn new() -> ControlPlane {
        ControlPlane {
            snapshot: Arc::new(watch::channel(None).0),
            requests: Arc::default(),
            headers: Arc::default(),
            stopped: watch::channel(false).1,
        }
    }

    fn push(&self, version: &str, resources: Vec<Any>) {
        self.snapshot
            .send_replace(Some((version.to_owned(), resources)));
    }

    fn requests(&self) -> Vec<DiscoveryRequest> {
        self.requests.lock().unwrap().clone()
    }

    /// Wait for the client's answer to the response of `version` (the ACK carries that
    /// version; a NACK carries an error): the request answering it.
    async fn answer_to(&self, count_before: usize) -> DiscoveryRequest {
        let start = Instant::now();
        loop {
            let requests = self.requests();
            if let Some(r) = requests[count_before.min(requests.len())..]
                .iter()
                .find(|r| !r.response_nonce.is_empty())
            {
                return r.clone();
            }
            assert!(
                start.elapsed() < WAIT,
                "no answer to the push: {requests:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Serve on `addr` (TLS when given) until `stop` fires.
    fn serve(
        &self,
        listener: std::net::TcpListener,
        tls: Option<ServerTlsConfig>,
    ) -> (watch::Sender<bool>, tokio::task::JoinHandle<()>) {
        let (stop, mut stopped) = watch::channel(false);
        let service = ControlPlane {
            stopped: stopped.clone(),
            ..self.clone()
        };
        let mut builder = Server::builder();
        if let Some(tls) = tls {
            builder = builder.tls_config(tls).unwrap();
        }
        listener.set_nonblocking(true).unwrap();
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let router = builder.add_service(AggregatedDiscoveryServiceServer::new(service));
        let task = tokio::spawn(async move {
            router
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
                .unwrap();
        });
        (stop, task)
    }
}

fn bind(addr: SocketAddr) -> std::net::TcpListener {
    std::net::TcpListener::bind(addr).expect("bind the control plane")
}

fn policy(unit: RateLimitUnit, requests_per_unit: u32) -> Option<RateLimitPolicy> {
    Some(RateLimitPolicy {
        unit: unit as i32,
        requests_per_unit,
        ..Default::default()
    })
}

/// One resource `name` for `domain` limiting `k` (any value) to `limit` per hour.
fn resource(name: &str, domain: &str, limit: u32) -> RateLimitConfig {
    resource_with(name, domain, policy(RateLimitUnit::Hour, limit))
}

fn resource_with(name: &str, domain: &str, rate_limit: Option<RateLimitPolicy>) -> RateLimitConfig {
    RateLimitConfig {
        name: name.into(),
        domain: domain.into(),
        descriptors: vec![RateLimitDescriptor {
            key: "k".into(),
            rate_limit,
            ..Default::default()
        }],
    }
}

fn any(config: &RateLimitConfig) -> Any {
    Any {
        type_url: TYPE_URL.into(),
        value: config.encode_to_vec(),
    }
}

/// Charge `hits` to (domain, k=probe); the answer's first status.
async fn hit(t: &Turnstile, domain: &str, hits: u64) -> (Option<u32>, u32) {
    let mut r = request(domain, vec![descriptor(&[("k", "probe")])]);
    r.descriptors[0].hits_addend = Some(UInt64Value { value: hits });
    status(t.call(r).await.expect("ShouldRateLimit"))
}

fn status(response: RateLimitResponse) -> (Option<u32>, u32) {
    let s = &response.statuses[0];
    (
        s.current_limit.as_ref().map(|l| l.requests_per_unit),
        s.limit_remaining,
    )
}

/// Wait until the limit in force for `domain` is `expected`.
async fn wait_for_limit(t: &Turnstile, domain: &str, expected: Option<u32>) {
    let start = Instant::now();
    while hit(t, domain, 0).await.0 != expected {
        assert!(
            start.elapsed() < WAIT,
            "limit of {domain} never became {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A whole HTTP/1.1 answer, headers included.
async fn raw_get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut answer))
        .await
        .expect("an answer in time")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

/// The reference's settings for a local control plane, with quick reconnects.
fn xds_env(server: SocketAddr) -> Vec<(&'static str, String)> {
    vec![
        ("CONFIG_TYPE", "GRPC_XDS_SOTW".into()),
        ("CONFIG_GRPC_XDS_SERVER_URL", server.to_string()),
        ("CONFIG_GRPC_XDS_NODE_ID", "test-node".into()),
        ("CONFIG_GRPC_XDS_NODE_METADATA", "zone=z1,tier=edge".into()),
        (
            "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
            "x-tenant:t1".into(),
        ),
        (
            "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
            "100ms".into(),
        ),
        ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "100ms".into()),
        ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "500ms".into()),
    ]
}

async fn start(env: &[(&'static str, String)]) -> Turnstile {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    Turnstile::start_with(&[], &env).await
}

enum Expect {
    Ack,
    /// NACKed with exactly this error text.
    Nack(&'static str),
}

/// A version, its resources, the answer expected, and the limits of d1 and d2 afterwards.
type Row = (&'static str, Vec<Any>, Expect, [Option<u32>; 2]);

/// Pushes in order, each a row: version, resources, the answer expected, then the limit in
/// force per domain afterwards (checked over gRPC on the real binary).
#[tokio::test]
async fn each_push_is_the_whole_rule_set_acked_or_nacked_with_the_old_rules_kept() {
    let plane = ControlPlane::new();
    let listener = bind("127.0.0.1:0".parse().unwrap());
    let addr = listener.local_addr().unwrap();
    let (_stop, _server) = plane.serve(listener, None);
    let garbage = Any {
        type_url: TYPE_URL.into(),
        value: vec![0xff, 0xff, 0xff],
    };
    let bad_unit = resource_with("a", "d1", policy(RateLimitUnit::Unknown, 4));
    let rows: Vec<Row> = vec![
        (
            "v1",
            vec![any(&resource("a", "d1", 3)), any(&resource("b", "d2", 5))],
            Expect::Ack,
            [Some(3), Some(5)],
        ),
        (
            "v2",
            vec![any(&resource("a", "d1", 4)), any(&resource("b", "d2", 5))],
            Expect::Ack,
            [Some(4), Some(5)],
        ),
        // Resource b removed: its domain goes.
        (
            "v3",
            vec![any(&resource("a", "d1", 4))],
            Expect::Ack,
            [Some(4), None],
        ),
        (
            "v4",
            vec![any(&bad_unit), any(&resource("b", "d2", 9))],
            Expect::Nack(
                "resource 'a' descriptors[0].rate_limit.unit: invalid rate limit unit 'UNKNOWN'",
            ),
            [Some(4), None],
        ),
        (
            "v5",
            vec![any(&resource("a", "d1", 4)), garbage],
            Expect::Nack(
                "resource 1 cannot be decoded: failed to decode Protobuf message: invalid varint",
            ),
            [Some(4), None],
        ),
        ("v6", vec![], Expect::Ack, [None, None]),
    ];

    plane.push(rows[0].0, rows[0].1.clone());
    let t = start(&xds_env(addr)).await;
    let mut accepted = "";
    for (i, (version, resources, expect, limits)) in rows.into_iter().enumerate() {
        let before = plane.requests().len();
        if i > 0 {
            plane.push(version, resources);
        }
        let answer = plane.answer_to(if i == 0 { 0 } else { before }).await;
        assert_eq!(answer.type_url, TYPE_URL);
        match expect {
            Expect::Ack => {
                assert_eq!(answer.error_detail, None, "{version}");
                assert_eq!(answer.version_info, version);
                accepted = version;
            }
            Expect::Nack(text) => {
                let detail = answer.error_detail.expect("a NACK carries the error");
                assert_eq!(detail.message, text, "{version}");
                assert_eq!(
                    answer.version_info, accepted,
                    "a NACK names the version in force"
                );
            }
        }
        for (domain, limit) in ["d1", "d2"].into_iter().zip(limits) {
            wait_for_limit(&t, domain, limit).await;
        }
        // What an alert reads: whether the last response was refused.
        let refused = matches!(expect, Expect::Nack(_));
        assert_eq!(
            t.metric("turnstile_rules_last_load_refused").await,
            Some(f64::from(u8::from(refused))),
            "{version}"
        );
        let health = raw_get(t.http, "/healthcheck").await.to_ascii_lowercase();
        assert!(health.starts_with("http/1.1 200"), "{health}");
        assert!(
            health.contains(&format!("\r\nx-turnstile-rules-source: xds {addr}\r\n")),
            "{health}"
        );
        assert!(
            health.contains(&format!("\r\nx-turnstile-rules-version: {accepted}\r\n")),
            "{health}"
        );
        let (_, rlconfig) = t.http_get("/rlconfig").await.unwrap();
        let first = rlconfig.lines().next().unwrap();
        assert!(
            first.starts_with(&format!("# version {accepted} loaded ")),
            "{first}"
        );
        assert!(first.ends_with(&format!("source xds {addr}")), "{first}");

        // Counters survive a push that changes only numbers: 2 hits under 3/h, then 1 under 4/h.
        match i {
            0 => assert_eq!(hit(&t, "d1", 2).await, (Some(3), 1)),
            1 => assert_eq!(hit(&t, "d1", 1).await, (Some(4), 1)),
            _ => {}
        }
    }
    let first = &plane.requests()[0];
    let node = first.node.as_ref().expect("the node is sent");
    assert_eq!(node.id, "test-node");
    assert_eq!(node.metadata.as_ref().unwrap().fields.len(), 2);
    assert_eq!(
        plane.headers.lock().unwrap()[0].get("x-tenant").unwrap(),
        "t1"
    );
    assert_eq!(
        t.metric("ratelimit_service_config_load_error").await,
        Some(2.0)
    );
    assert_eq!(
        t.metric("ratelimit_service_config_load_success").await,
        Some(4.0)
    );
    assert_eq!(
        t.metric("turnstile_xds_responses{result=\"ack\"}").await,
        Some(4.0)
    );
    assert_eq!(
        t.metric("turnstile_xds_responses{result=\"nack\"}").await,
        Some(2.0)
    );
}

/// Not serving before the first push; a control plane that goes away leaves the rules in
/// force; it comes back on the same address with new rules, and the client follows.
#[tokio::test]
async fn the_last_good_rules_outlive_the_control_plane_and_its_restart() {
    let plane = ControlPlane::new();
    let listener = bind("127.0.0.1:0".parse().unwrap());
    let addr = listener.local_addr().unwrap();
    let (stop, server) = plane.serve(listener, None);
    let pushed_at = Arc::new(Mutex::new(None));
    let pusher = tokio::spawn({
        let (plane, pushed_at) = (plane.clone(), pushed_at.clone());
        async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            *pushed_at.lock().unwrap() = Some(Instant::now());
            plane.push("v1", vec![any(&resource("a", "d1", 3))]);
        }
    });
    // start() returns once /healthcheck says 200: that must not happen before the push.
    let mut t = start(&xds_env(addr)).await;
    assert!(
        pushed_at.lock().unwrap().is_some(),
        "healthy before any rules arrived"
    );
    pusher.await.unwrap();
    assert!(!plane.requests().is_empty());
    wait_for_limit(&t, "d1", Some(3)).await;
    // `d1`'s counter is followed through the restart (seconds): one hour's.
    clear_of_end(HOUR, Duration::from_secs(20)).await;
    assert_eq!(hit(&t, "d1", 1).await, (Some(3), 2));
    // SIGHUP reloads files; with xDS it must change nothing (its default action is exit,
    // which the kernel takes before kill() returns: a call answered after it shows none).
    signal(t.pid(), "HUP");
    assert_eq!(
        hit(&t, "d1", 0).await,
        (Some(3), 2),
        "answered after SIGHUP"
    );
    assert!(t.alive(), "SIGHUP stopped the process");

    // The control plane goes away: rules and counters stay, and so does health, once
    // turnstile has seen it go (it dials the address again: a listener there sees it).
    stop.send_replace(true);
    server.await.unwrap();
    // The listener the control plane comes back on, which sees the dial first.
    let again = bind(addr);
    let redial = again.try_clone().unwrap();
    redial.set_nonblocking(true).unwrap();
    let redial = tokio::net::TcpListener::from_std(redial).unwrap();
    tokio::time::timeout(WAIT, redial.accept())
        .await
        .expect("turnstile never dialled the control plane again")
        .expect("accept");
    drop(redial);
    assert_eq!(hit(&t, "d1", 1).await, (Some(3), 1));
    let (status, _) = t.http_get("/healthcheck").await.unwrap();
    assert_eq!(status, 200);

    // Back on the same address, with other rules.
    let before = plane.requests().len();
    plane.push("v2", vec![any(&resource("a", "d1", 7))]);
    let (_stop, _server) = plane.serve(again, None);
    wait_for_limit(&t, "d1", Some(7)).await;
    let resubscribe = &plane.requests()[before];
    assert_eq!(
        (
            resubscribe.version_info.as_str(),
            resubscribe.response_nonce.as_str()
        ),
        ("v1", ""),
        "a new stream starts from the version in force"
    );
    assert_eq!(
        hit(&t, "d1", 1).await,
        (Some(7), 4),
        "counters survive the reconnect"
    );
}

/// A push just under XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES is enforced; one over it is refused
/// by the transport and changes nothing; the next good push is taken.
#[tokio::test]
async fn a_push_near_the_message_limit() {
    const LIMIT: usize = 1 << 20;
    let plane = ControlPlane::new();
    let listener = bind("127.0.0.1:0".parse().unwrap());
    let addr = listener.local_addr().unwrap();
    let (_stop, _server) = plane.serve(listener, None);
    let big = |size: usize| {
        // A day's window: the test counts on one counter across a second's sleep, which a
        // minute's window could end in between (it did, once, in CI).
        let one = RateLimitDescriptor {
            key: "k".into(),
            value: "v00000000".into(),
            rate_limit: policy(RateLimitUnit::Day, 10),
            ..Default::default()
        };
        // Each descriptor costs its length plus a tag and a 1-byte length.
        let count = size / (one.encoded_len() + 2);
        let config = RateLimitConfig {
            name: "big".into(),
            domain: "big".into(),
            descriptors: (0..count)
                .map(|i| RateLimitDescriptor {
                    value: format!("v{i:08}"),
                    ..one.clone()
                })
                .collect(),
        };
        (any(&config), count)
    };
    let encoded = |resources: &[Any]| {
        DiscoveryResponse {
            version_info: "vX".into(),
            resources: resources.to_vec(),
            type_url: TYPE_URL.into(),
            nonce: "99".into(),
            ..Default::default()
        }
        .encoded_len()
    };
    let (under, count) = big(LIMIT - 4096);
    let size = encoded(std::slice::from_ref(&under));
    assert!(size < LIMIT && size > LIMIT * 99 / 100, "{size}");
    plane.push("v1", vec![under]);
    let mut env = xds_env(addr);
    env.push(("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", LIMIT.to_string()));
    let t = start(&env).await;
    let last = format!("v{:08}", count - 1);
    let check = |value: String| {
        let t = &t;
        async move {
            let r = request("big", vec![descriptor(&[("k", &value)])]);
            status(t.call(r).await.unwrap())
        }
    };
    assert_eq!(check(last.clone()).await, (Some(10), 9));
    println!("a {size}-byte push of {count} descriptors is in force");

    let (over, _) = big(LIMIT + 4096);
    let other = any(&resource("a", "d1", 3));
    let before = plane.requests().len();
    plane.push("v2", vec![over, other]);
    // Refused by the transport: the stream ends, and turnstile opens another from v1.
    let started = Instant::now();
    while !plane.requests()[before..]
        .iter()
        .any(|r| (r.version_info.as_str(), r.response_nonce.as_str()) == ("v1", ""))
    {
        assert!(
            started.elapsed() < WAIT,
            "no new stream after the oversized push"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        !plane.requests().iter().any(|r| r.version_info == "v2"),
        "the oversized push was ACKed"
    );
    assert_eq!(
        check(last.clone()).await,
        (Some(10), 8),
        "the old rules stay"
    );
    assert_eq!(hit(&t, "d1", 0).await.0, None);
    assert!(t.http_get("/healthcheck").await.unwrap().0 == 200);

    plane.push("v3", vec![any(&resource("a", "d1", 3))]);
    wait_for_limit(&t, "d1", Some(3)).await;
    assert_eq!(check(last).await.0, None);
}

struct Certs {
    dir: tempfile::TempDir,
    ca: String,
    server: Identity,
}

impl Certs {
    /// A CA, a server certificate for `localhost` and a client one, as PEM files in `dir`
    /// named as Envoy Gateway mounts them (the same pair serves both sides there).
    fn new() -> Certs {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        for (name, pem) in [
            ("ca.crt", ca.pem()),
            ("tls.crt", cert.pem()),
            ("tls.key", key.serialize_pem()),
        ] {
            std::fs::write(dir.path().join(name), pem).unwrap();
        }
        Certs {
            dir,
            ca: ca.pem(),
            server: Identity::from_pem(cert.pem(), key.serialize_pem()),
        }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }

    /// The control plane's TLS: its certificate, and clients must present one the CA signed.
    fn mutual(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.server.clone())
            .client_ca_root(Certificate::from_pem(&self.ca))
    }
}

/// Exactly the environment Envoy Gateway gives its rate-limit deployment (its TLS files, the
/// Redis, statsd), but for the addresses: the control plane's and Redis's are local, and the
/// harness picks free listen ports. Rules arrive over mTLS and are enforced over server TLS
/// only: Envoy Gateway names its CA `GRPC_SERVER_TLS_CA_CERT`, which neither turnstile nor
/// the reference reads (client certificates are asked for by `GRPC_CLIENT_TLS_CACERT`, tested
/// in tests/core.rs), so a client without a certificate is answered.
#[tokio::test]
async fn envoy_gateways_environment_takes_rules_over_mtls_and_serves_over_server_tls() {
    let certs = Certs::new();
    let redis = RedisServer::start();
    let plane = ControlPlane::new();
    let listener = bind("127.0.0.1:0".parse().unwrap());
    let port = listener.local_addr().unwrap().port();
    let (_stop, _server) = plane.serve(listener, Some(certs.mutual()));
    plane.push("1", vec![any(&resource("envoy-gateway/gw/route", "eg", 2))]);

    let env: Vec<(&str, String)> = vec![
        ("RUNTIME_ROOT", "/data".into()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".into()),
        ("RUNTIME_IGNOREDOTFILES", "true".into()),
        ("RUNTIME_WATCH_ROOT", "false".into()),
        ("LOG_LEVEL", "info".into()),
        ("USE_STATSD", "true".into()),
        ("STATSD_PORT", "9125".into()),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW".into()),
        ("CONFIG_GRPC_XDS_SERVER_URL", format!("localhost:{port}")),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit".into()),
        ("GRPC_SERVER_USE_TLS", "true".into()),
        ("GRPC_SERVER_TLS_CERT", certs.path("tls.crt")),
        ("GRPC_SERVER_TLS_KEY", certs.path("tls.key")),
        // Not read: the server asks no client certificate.
        ("GRPC_SERVER_TLS_CA_CERT", certs.path("ca.crt")),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".into()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", certs.path("tls.crt")),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", certs.path("tls.key")),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", certs.path("ca.crt")),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true".into()),
        ("REDIS_SOCKET_TYPE", "tcp".into()),
        ("REDIS_URL", redis.addr()),
        // As every test through a debug binary on a busy runner: the 25 ms default is for
        // release builds (this test is about where the rules come from).
        ("TURNSTILE_REDIS_TIMEOUT", "2s".into()),
    ];
    let t = start(&env).await;
    let answer = plane.answer_to(0).await;
    assert_eq!(
        (answer.version_info.as_str(), answer.error_detail),
        ("1", None)
    );
    assert_eq!(answer.node.unwrap().id, "envoy-ratelimit");

    // No client identity: server TLS only.
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&certs.ca))
        .domain_name("localhost");
    let channel = Channel::from_shared(format!("https://localhost:{}", t.grpc.port()))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .expect("the RLS over TLS, without a client certificate");
    let mut client = RateLimitServiceClient::new(channel);
    let mut outcomes = Vec::new();
    for _ in 0..3 {
        let r = request("eg", vec![descriptor(&[("k", "user-1")])]);
        let response = client.should_rate_limit(r).await.unwrap().into_inner();
        outcomes.push((response.overall_code, status(response)));
    }
    assert_eq!(
        outcomes,
        [(1, (Some(2), 1)), (1, (Some(2), 0)), (2, (Some(2), 0))],
        "OK, OK, then OVER_LIMIT"
    );
    assert!(!redis.keys("*").is_empty(), "the counters are in Redis");
}

/// CONFIG_GRPC_XDS_SERVER_TLS_SAN names the certificate's host when the URL is an address;
/// without a client certificate the control plane refuses, and no rules means not serving.
#[tokio::test]
async fn tls_verifies_the_configured_name_and_presents_the_client_certificate() {
    let certs = Certs::new();
    let plane = ControlPlane::new();
    let listener = bind("127.0.0.1:0".parse().unwrap());
    let addr = listener.local_addr().unwrap();
    let (_stop, _server) = plane.serve(listener, Some(certs.mutual()));
    plane.push("1", vec![any(&resource("a", "d1", 6))]);
    let mut env = xds_env(addr);
    env.extend([
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".to_owned()),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", certs.path("ca.crt")),
        ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "localhost".to_owned()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", certs.path("tls.crt")),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", certs.path("tls.key")),
    ]);
    let t = start(&env).await;
    assert_eq!(hit(&t, "d1", 0).await.0, Some(6));
    drop(t);

    // No client certificate: the control plane refuses the handshake, no rules ever arrive.
    let before = plane.requests().len();
    let without_cert: Vec<(&str, String)> = env
        .into_iter()
        .filter(|(k, _)| !k.starts_with("CONFIG_GRPC_XDS_CLIENT_TLS"))
        .collect();
    let env: Vec<(&str, &str)> = without_cert.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let outcome =
        tokio::time::timeout(Duration::from_secs(3), Turnstile::start_with(&[], &env)).await;
    assert!(outcome.is_err(), "healthy without rules");
    assert_eq!(
        plane.requests().len(),
        before,
        "no stream without a client certificate"
    );
}
