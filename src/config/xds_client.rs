//! Rules from a control plane (CONFIG_TYPE=GRPC_XDS_SOTW), as the reference's xDS provider
//! takes them: an ADS state-of-the-world stream subscribed to every `RateLimitConfig`.
//!
//! Each response is the whole rule set: validated as a whole (`config::xds`), swapped in
//! atomically and ACKed, or NACKed with the errors while the rules in force stay. Unlike the
//! reference, whose backoff reads XDS_CLIENT_BACKOFF_RANDOM_FACTOR as a growth factor (so
//! every retry waits the initial interval), the wait here doubles up to the maximum, with
//! jitter, and starts over once a stream delivered a response.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::{Struct, Value, value};
use envoy_types::pb::google::rpc::Status;
use prost::Message;
use tokio::sync::mpsc;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::config::active::ActiveRules;
use crate::config::xds::{self as rules, TYPE_URL, pb::RateLimitConfig};
use crate::ops::metrics::Metrics;
use crate::ops::rules_series::RulesSeries;

/// Bound on one connection attempt (TCP and TLS).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 pings find a control plane that vanished without closing the connection.
const KEEPALIVE: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// Shortest wait before any reconnect, whatever the settings: a control plane that closes
/// every stream at once must not make the client spin.
const MIN_WAIT: Duration = Duration::from_millis(50);
/// Errors of one refused push quoted in its NACK and logs; a push can hold many thousands,
/// and the NACK must stay far below any message limit.
const MAX_ERRORS_QUOTED: usize = 20;

/// The reference's XDS_CLIENT_BACKOFF_* settings.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    pub random_factor: f64,
    pub jitter: bool,
}

impl Backoff {
    /// The wait before reconnect number `attempt` (0-based).
    pub fn delay(&self, attempt: u32) -> Duration {
        let base = self
            .initial
            .saturating_mul(1 << attempt.min(30))
            .min(self.max);
        let wait = match self.jitter {
            true => {
                let spread = self.random_factor.clamp(0.0, 1.0) * (2.0 * fastrand::f64() - 1.0);
                scale(base, 1.0 + spread).min(self.max)
            }
            false => base,
        };
        wait.max(MIN_WAIT)
    }
}

/// Everything the client needs, read and checked at start-up.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `host:port` (as the reference takes it) or a URL.
    pub server_url: String,
    pub node: Node,
    pub headers: MetadataMap,
    pub tls: Option<ClientTlsConfig>,
    pub connect_retry_interval: Duration,
    pub max_message_bytes: Option<usize>,
    pub backoff: Backoff,
    pub merge_domains: bool,
}

/// CONFIG_GRPC_XDS_NODE_METADATA: `key=value` pairs separated by commas; entries without `=`
/// are skipped, as the reference does.
pub fn node(id: &str, metadata: &str) -> Node {
    let fields = metadata
        .split(',')
        .filter_map(|entry| entry.split_once('='))
        .map(|(k, v)| {
            let value = Value {
                kind: Some(value::Kind::StringValue(v.to_owned())),
            };
            (k.to_owned(), value)
        })
        .collect();
    Node {
        id: id.to_owned(),
        metadata: Some(Struct { fields }),
        user_agent_name: "turnstile".to_owned(),
        ..Default::default()
    }
}

/// CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS, in the reference's map form `k1:v1,k2:v2`.
pub fn headers(text: &str) -> anyhow::Result<MetadataMap> {
    let mut headers = MetadataMap::new();
    for entry in text.split(',').filter(|e| !e.trim().is_empty()) {
        let (key, value) = entry
            .split_once(':')
            .with_context(|| format!("header '{entry}' is not key:value"))?;
        let key = MetadataKey::from_bytes(key.trim().to_ascii_lowercase().as_bytes())
            .with_context(|| format!("invalid header name '{key}'"))?;
        let value = MetadataValue::try_from(value.trim())
            .with_context(|| format!("invalid value for header '{key}'"))?;
        headers.insert(key, value);
    }
    Ok(headers)
}

/// TLS to the control plane: its CA (else the public roots), our certificate for mTLS, and
/// the name to verify when it is not the URL's host.
pub fn tls(
    ca: Option<Vec<u8>>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
    san: Option<&str>,
) -> ClientTlsConfig {
    let mut tls = ClientTlsConfig::new();
    tls = match ca {
        Some(ca) => tls.ca_certificate(Certificate::from_pem(ca)),
        None => tls.with_webpki_roots(),
    };
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    if let Some(san) = san.filter(|s| !s.is_empty()) {
        tls = tls.domain_name(san);
    }
    tls
}

pub struct Client {
    settings: Settings,
    endpoint: Endpoint,
    rules: Arc<ActiveRules>,
    series: RulesSeries,
    /// The version of the last accepted response, sent on reconnects and NACKs.
    accepted: String,
}

impl Client {
    pub fn new(
        settings: Settings,
        rules: Arc<ActiveRules>,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Client> {
        let url = if settings.server_url.contains("://") {
            settings.server_url.clone()
        } else {
            let scheme = if settings.tls.is_some() {
                "https"
            } else {
                "http"
            };
            format!("{scheme}://{}", settings.server_url)
        };
        let mut endpoint = Endpoint::from_shared(url.clone())
            .with_context(|| format!("CONFIG_GRPC_XDS_SERVER_URL '{url}'"))?
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(KEEPALIVE)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true);
        if let Some(tls) = &settings.tls {
            endpoint = endpoint.tls_config(tls.clone()).context("xDS client TLS")?;
        }
        Ok(Client {
            settings,
            endpoint,
            rules,
            series: RulesSeries::new(metrics),
            accepted: String::new(),
        })
    }

    /// Connect, follow the stream, reconnect when it ends; forever.
    pub async fn run(mut self) {
        tokio::spawn(ignore_sighup());
        let mut attempt = 0;
        loop {
            let channel = match self.endpoint.connect().await {
                Ok(channel) => channel,
                Err(error) => {
                    tracing::warn!(server = %self.settings.server_url, error = %error_chain(&error), "cannot connect to the xDS server");
                    let interval = self.settings.connect_retry_interval;
                    tokio::time::sleep(scale(interval, 0.5 + fastrand::f64()).max(MIN_WAIT)).await;
                    continue;
                }
            };
            tracing::info!(server = %self.settings.server_url, "connected to the xDS server");
            let (responses, result) = self.follow(channel).await;
            if let Err(status) = result {
                tracing::warn!(code = ?status.code(), message = status.message(), "xDS stream ended; the rules in force stay");
            }
            if responses > 0 {
                attempt = 0;
            }
            let delay = self.settings.backoff.delay(attempt);
            attempt = attempt.saturating_add(1);
            tracing::info!(?delay, "reconnecting to the xDS server");
            tokio::time::sleep(delay).await;
        }
    }

    /// One stream: subscribe, then apply and answer each response. The responses handled,
    /// and why the stream ended.
    async fn follow(&mut self, channel: Channel) -> (u64, Result<(), tonic::Status>) {
        let mut client = AggregatedDiscoveryServiceClient::new(channel);
        if let Some(max) = self.settings.max_message_bytes {
            client = client.max_decoding_message_size(max);
        }
        // Only this task sends: one request per response, so the channel never holds more.
        let (tx, rx) = mpsc::channel::<DiscoveryRequest>(2);
        let _ = tx.try_send(self.request(self.accepted.clone(), String::new(), None));
        let outbound = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|request| (request, rx))
        });
        let mut request = tonic::Request::new(outbound);
        *request.metadata_mut() = self.settings.headers.clone();
        let mut inbound = match client.stream_aggregated_resources(request).await {
            Ok(response) => response.into_inner(),
            Err(status) => return (0, Err(status)),
        };
        let mut handled = 0;
        loop {
            let response = match inbound.message().await {
                Ok(Some(response)) => response,
                Ok(None) => return (handled, Ok(())),
                Err(status) => return (handled, Err(status)),
            };
            handled += 1;
            let reply = match self.apply(&response) {
                Ok(()) => {
                    self.accepted = response.version_info.clone();
                    self.request(self.accepted.clone(), response.nonce, None)
                }
                Err(detail) => {
                    let status = Status {
                        code: tonic::Code::InvalidArgument as i32,
                        message: detail,
                        details: Vec::new(),
                    };
                    self.request(self.accepted.clone(), response.nonce, Some(status))
                }
            };
            if tx.send(reply).await.is_err() {
                return (handled, Ok(()));
            }
        }
    }

    fn request(&self, version: String, nonce: String, error: Option<Status>) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: version,
            node: Some(self.settings.node.clone()),
            type_url: TYPE_URL.to_owned(),
            response_nonce: nonce,
            error_detail: error,
            ..Default::default()
        }
    }

    /// Validate the whole response and swap it in; the reason when it is refused.
    fn apply(&self, response: &DiscoveryResponse) -> Result<(), String> {
        let version = &response.version_info;
        let loaded = decode(response)
            .and_then(|configs| rules::load(&configs, self.settings.merge_domains, version));
        match loaded {
            Ok(rules) => {
                let domains = rules.domains().count();
                self.rules.replace(rules);
                self.series.acked(version);
                tracing::info!(%version, domains, "rules from xDS in force");
                Ok(())
            }
            Err(detail) => {
                let detail = quote(&detail);
                self.series.nacked();
                for error in detail.lines() {
                    tracing::error!(%version, %error, "xDS rules refused; the previous rules stay in force");
                }
                Err(detail)
            }
        }
    }
}

/// SIGHUP reloads rule files; here there is nothing to reload, and its default action (exit)
/// must not stop the service.
async fn ignore_sighup() {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        return;
    };
    while hup.recv().await.is_some() {
        tracing::info!("SIGHUP ignored: the rules come from xDS");
    }
}

/// `duration` × `factor` (≥ 0), saturating instead of panicking on overflow.
fn scale(duration: Duration, factor: f64) -> Duration {
    Duration::try_from_secs_f64(duration.as_secs_f64() * factor).unwrap_or(Duration::MAX)
}

/// The first MAX_ERRORS_QUOTED lines of `errors`, and how many more there were.
fn quote(errors: &str) -> String {
    let total = errors.lines().count();
    if total <= MAX_ERRORS_QUOTED {
        return errors.to_owned();
    }
    let mut quoted: Vec<&str> = errors.lines().take(MAX_ERRORS_QUOTED).collect();
    let more = format!("... and {} more errors", total - MAX_ERRORS_QUOTED);
    quoted.push(&more);
    quoted.join("\n")
}

fn decode(response: &DiscoveryResponse) -> Result<Vec<RateLimitConfig>, String> {
    if response.type_url != TYPE_URL {
        return Err(format!(
            "unexpected type_url '{}' (expected {TYPE_URL})",
            response.type_url
        ));
    }
    response
        .resources
        .iter()
        .enumerate()
        .map(|(i, any)| {
            if any.type_url != TYPE_URL {
                return Err(format!(
                    "resource {i} has type_url '{}' (expected {TYPE_URL})",
                    any.type_url
                ));
            }
            RateLimitConfig::decode(any.value.as_slice())
                .map_err(|e| format!("resource {i} cannot be decoded: {e}"))
        })
        .collect()
}

/// A transport error with its causes (the top level alone says only "transport error").
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_max_and_jitter_stays_within_the_factor() {
        let backoff = Backoff {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(60),
            random_factor: 0.5,
            jitter: false,
        };
        let waits: Vec<u64> = (0..5).map(|a| backoff.delay(a).as_secs()).collect();
        assert_eq!(waits, [10, 20, 40, 60, 60]);
        assert_eq!(backoff.delay(u32::MAX), Duration::from_secs(60));
        let zero = Backoff {
            initial: Duration::ZERO,
            max: Duration::ZERO,
            ..backoff
        };
        assert_eq!(zero.delay(0), MIN_WAIT, "never a hot reconnect loop");
        let huge = Backoff {
            initial: Duration::MAX,
            max: Duration::MAX,
            random_factor: 1.0,
            jitter: true,
        };
        assert!(
            huge.delay(3) > Duration::from_secs(1 << 40),
            "saturates, no panic"
        );
        let jittered = Backoff {
            jitter: true,
            ..backoff
        };
        for _ in 0..200 {
            let first = jittered.delay(0);
            assert!(first >= Duration::from_secs(5) && first <= Duration::from_secs(15));
            assert!(jittered.delay(9) <= Duration::from_secs(60));
        }
    }

    #[test]
    fn a_nack_quotes_a_bounded_number_of_errors() {
        let few = "a\nb";
        assert_eq!(quote(few), few);
        let many: Vec<String> = (0..1000).map(|i| format!("error {i}")).collect();
        let quoted = quote(&many.join("\n"));
        assert_eq!(quoted.lines().count(), MAX_ERRORS_QUOTED + 1);
        assert_eq!(quoted.lines().last(), Some("... and 980 more errors"));
    }

    #[test]
    fn node_metadata_and_headers_take_the_references_forms() {
        let node = node("envoy-ratelimit", "a=1,b=x=y,junk,");
        assert_eq!(node.id, "envoy-ratelimit");
        let fields = &node.metadata.unwrap().fields;
        let text = |k: &str| match &fields[k].kind {
            Some(value::Kind::StringValue(s)) => s.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(fields.len(), 2);
        assert_eq!((text("a"), text("b")), ("1".to_owned(), "x=y".to_owned()));

        let map = headers("X-Token:abc, x-other : 2").unwrap();
        assert_eq!(map.get("x-token").unwrap(), "abc");
        assert_eq!(map.get("x-other").unwrap(), "2");
        assert!(headers("").unwrap().is_empty());
        assert!(headers("novalue").is_err());
        assert!(headers("bad header:1").is_err());
    }
}
