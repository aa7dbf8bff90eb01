//! Logs and traces. Logs go to stderr as text or JSON, filtered by LOG_LEVEL. Traces are in
//! every build, on by configuration (`TracingArgs`: the reference's TRACING_* variables and
//! the standard OTEL_* ones): each decision is then one span, `ShouldRateLimit`, with the
//! domain, the outcome and the backend's time, continuing the W3C trace context
//! (`traceparent`) its caller sent, exported over OTLP in batches.
//!
//! Off, the decision span is at TRACE level where nothing listens: it is never built. On,
//! finished spans wait in the SDK's bounded queue and are exported from the SDK's own
//! thread, so a slow or absent collector costs a call nothing; spans that find the queue
//! full are dropped (the SDK logs the first drop, and the total at shutdown).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::{Context as _, bail};
use http::HeaderMap;
use opentelemetry::KeyValue;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithTonicConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanExporter};
use pin_project_lite::pin_project;
use tokio::runtime::Handle;
use tracing::Span;
use tracing::field::Empty;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, fmt};

/// How log lines are written (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Traces over OTLP, with the reference's settings (names and defaults). The exporter's
/// own settings (endpoint, headers, timeout, queue) are the standard `OTEL_*` variables,
/// read by the OpenTelemetry SDK.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TracingArgs {
    /// Export traces (`true`/`false`). Unset: on when OTEL_EXPORTER_OTLP_ENDPOINT (or
    /// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set, unless OTEL_SDK_DISABLED=true.
    #[arg(long, env = "TRACING_ENABLED", value_parser = clap::builder::BoolishValueParser::new())]
    pub tracing_enabled: Option<bool>,
    /// OTLP over `http` (protobuf, the reference's default) or `grpc`. Unset:
    /// OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL, else http.
    #[arg(
        long,
        env = "TRACING_EXPORTER_PROTOCOL",
        value_enum,
        ignore_case = true
    )]
    pub tracing_exporter_protocol: Option<OtlpProtocol>,
    /// The resource's service.name. Unset: OTEL_SERVICE_NAME, else `service.name` in
    /// OTEL_RESOURCE_ATTRIBUTES, else the reference's `RateLimit`.
    #[arg(long, env = "TRACING_SERVICE_NAME")]
    pub tracing_service_name: Option<String>,
    /// The resource's service.namespace (none by default).
    #[arg(long, env = "TRACING_SERVICE_NAMESPACE")]
    pub tracing_service_namespace: Option<String>,
    /// The resource's service.instance.id (default: a random UUID, as the reference).
    #[arg(long, env = "TRACING_SERVICE_INSTANCE_ID")]
    pub tracing_service_instance_id: Option<String>,
    /// Share of new traces sampled, 0 to 1; a call whose caller sent a sampled trace
    /// context is traced whatever the ratio (the reference's parent-based sampler). Unset:
    /// OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG, else 1.
    #[arg(long, env = "TRACING_SAMPLING_RATE", value_parser = ratio)]
    pub tracing_sampling_rate: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OtlpProtocol {
    /// OTLP/HTTP with protobuf bodies (port 4318 by convention).
    Http,
    /// OTLP/gRPC (port 4317 by convention).
    Grpc,
}

/// A share from 0 to 1.
fn ratio(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(ratio) if (0.0..=1.0).contains(&ratio) => Ok(ratio),
        _ => Err(format!("{text}: not a ratio from 0 to 1")),
    }
}

/// The decision spans' target: the trace exporter listens to it alone.
const DECISIONS: &str = "turnstile::decision";

/// The reference's service name, when nothing names one.
const SERVICE_NAME: &str = "RateLimit";

/// Keeps the trace exporter alive; dropping it flushes the spans still queued.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            let _ = provider.shutdown();
        }
    }
}

/// The Redis client's own warnings, unless LOG_LEVEL names its target: it warns once per
/// failed connection attempt (dozens a second while a Cluster master is down), where the
/// backend logs one line per event (a master switched, slots moved).
const REDIS_CLIENT: &str = "redis=error";

/// Logs, and traces when `settings` turn them on. Called within the runtime the exporter
/// uses. A setting that cannot work (a protocol that is not OTLP's, an endpoint the
/// exporter refuses) is an error, before anything is served.
pub fn init(level: &str, format: LogFormat, settings: &TracingArgs) -> anyhow::Result<Telemetry> {
    use std::io::IsTerminal;
    let traces = if enabled(settings) {
        let protocol = protocol(settings)?;
        Some((provider(settings, protocol)?, protocol))
    } else {
        None
    };
    let filter = EnvFilter::try_new(level).unwrap_or_else(|_| EnvFilter::new("info"));
    let filter = if level.contains("redis") || level.trim().eq_ignore_ascii_case("off") {
        filter
    } else {
        filter.add_directive(REDIS_CLIENT.parse().expect("a valid directive"))
    };
    let logs = fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let logs = match format {
        LogFormat::Text => logs.boxed(),
        LogFormat::Json => logs.json().boxed(),
    };
    let mut layers = vec![logs.with_filter(filter).boxed()];
    if let Some((provider, _)) = &traces {
        // Only what a span needs: the location, thread and timing attributes the layer
        // adds by default would cost every span and say nothing about a decision.
        let traces = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("turnstile"))
            .with_location(false)
            .with_threads(false)
            .with_level(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_filter(Targets::new().with_target(DECISIONS, LevelFilter::TRACE));
        layers.push(traces.boxed());
    }
    tracing_subscriber::registry().with(layers).init();
    if let Some((_, protocol)) = &traces {
        tracing::info!(
            ?protocol,
            endpoint = %endpoint().unwrap_or_else(|| "the default".to_owned()),
            sampling_rate = ?settings.tracing_sampling_rate,
            "exporting traces over OTLP"
        );
    }
    Ok(Telemetry {
        provider: traces.map(|(provider, _)| provider),
    })
}

/// The span of one decision, a child of the trace context in its call's `headers` if any.
/// Its fields are recorded as the decision goes (`domain`, `outcome`, `backend_time_us`).
pub fn decision_span(headers: &HeaderMap) -> Span {
    let span = tracing::trace_span!(
        target: DECISIONS,
        parent: None,
        "ShouldRateLimit",
        otel.kind = "server",
        otel.status_code = Empty,
        domain = Empty,
        outcome = Empty,
        backend_time_us = Empty,
        backend_error = Empty,
    );
    if !span.is_disabled() && headers.contains_key("traceparent") {
        let parent = TraceContextPropagator::new().extract(&Headers(headers));
        // Fails only without the trace layer (a span enabled by LOG_LEVEL=trace alone).
        let _ = span.set_parent(parent);
    }
    span
}

/// A call's headers, as the propagator reads them.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|name| name.as_str()).collect()
    }
}

/// On when TRACING_ENABLED says so; unset, when an OTLP endpoint is given (unless the
/// standard OTEL_SDK_DISABLED switch is on).
fn enabled(settings: &TracingArgs) -> bool {
    settings.tracing_enabled.unwrap_or_else(|| {
        let endpoint = [
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ]
        .iter()
        .any(|name| variable(name).is_some());
        let disabled =
            variable("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"));
        endpoint && !disabled
    })
}

/// An environment variable's value, if set and not empty.
fn variable(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .filter(|value| !value.trim().is_empty())
}

/// TRACING_EXPORTER_PROTOCOL, else the standard variables, else the reference's http.
fn protocol(settings: &TracingArgs) -> anyhow::Result<OtlpProtocol> {
    if let Some(protocol) = settings.tracing_exporter_protocol {
        return Ok(protocol);
    }
    let standard = variable("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|| variable("OTEL_EXPORTER_OTLP_PROTOCOL"));
    match standard.as_deref().map(str::trim) {
        None | Some("http/protobuf") => Ok(OtlpProtocol::Http),
        Some("grpc") => Ok(OtlpProtocol::Grpc),
        Some(other) => bail!(
            "OTLP protocol {other:?} is not supported: grpc or http/protobuf \
             (OTEL_EXPORTER_OTLP_PROTOCOL, or TRACING_EXPORTER_PROTOCOL grpc or http)"
        ),
    }
}

/// The collector's address as set, if it is.
fn endpoint() -> Option<String> {
    variable("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .or_else(|| variable("OTEL_EXPORTER_OTLP_ENDPOINT"))
}

fn provider(settings: &TracingArgs, protocol: OtlpProtocol) -> anyhow::Result<SdkTracerProvider> {
    let endpoint = endpoint().unwrap_or_default();
    let tls = endpoint.trim().starts_with("https://");
    let builder = opentelemetry_otlp::SpanExporter::builder();
    let exporter = match protocol {
        OtlpProtocol::Http => {
            if tls {
                bail!(
                    "OTLP over HTTPS ({endpoint}) needs TRACING_EXPORTER_PROTOCOL=grpc: \
                     the HTTP exporter speaks plain HTTP"
                );
            }
            builder
                .with_http()
                .with_protocol(Protocol::HttpBinary)
                .build()
        }
        OtlpProtocol::Grpc if tls => builder
            .with_tonic()
            .with_tls_config(tonic::transport::ClientTlsConfig::new().with_webpki_roots())
            .build(),
        OtlpProtocol::Grpc => builder.with_tonic().build(),
    }
    .context("cannot set up the OTLP trace exporter")?;
    let runtime = Handle::try_current().context("the trace exporter needs the runtime")?;
    let mut provider = SdkTracerProvider::builder()
        .with_batch_exporter(OnRuntime { exporter, runtime })
        .with_resource(resource(settings));
    // Unset, the SDK's own sampler: OTEL_TRACES_SAMPLER's, else every trace.
    if let Some(ratio) = settings.tracing_sampling_rate {
        provider = provider.with_sampler(Sampler::ParentBased(Box::new(
            Sampler::TraceIdRatioBased(ratio),
        )));
    }
    Ok(provider.build())
}

/// The SDK's resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES) under the reference's
/// settings, which win where set.
fn resource(settings: &TracingArgs) -> Resource {
    let standard = variable("OTEL_RESOURCE_ATTRIBUTES").unwrap_or_default();
    let named = |key: &str| {
        standard.split(',').any(|pair| {
            pair.split_once('=')
                .is_some_and(|(name, _)| name.trim() == key)
        })
    };
    let mut builder = Resource::builder();
    let name = settings.tracing_service_name.clone().or_else(|| {
        (variable("OTEL_SERVICE_NAME").is_none() && !named("service.name"))
            .then(|| SERVICE_NAME.to_owned())
    });
    if let Some(name) = name {
        builder = builder.with_service_name(name);
    }
    if let Some(namespace) = settings
        .tracing_service_namespace
        .clone()
        .filter(|n| !n.is_empty())
    {
        builder = builder.with_attribute(KeyValue::new("service.namespace", namespace));
    }
    let instance = match settings
        .tracing_service_instance_id
        .clone()
        .filter(|id| !id.is_empty())
    {
        Some(id) => Some(id),
        None => (!named("service.instance.id")).then(random_uuid),
    };
    if let Some(instance) = instance {
        builder = builder.with_attribute(KeyValue::new("service.instance.id", instance));
    }
    builder.build()
}

/// A version 4 (random) UUID, the reference's instance id when none is given.
fn random_uuid() -> String {
    let mut bits = fastrand::u128(..);
    bits = (bits & !(0xf << 76)) | (0x4 << 76);
    bits = (bits & !(0x3 << 62)) | (0x2 << 62);
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        bits >> 96,
        (bits >> 80) & 0xffff,
        (bits >> 64) & 0xffff,
        (bits >> 48) & 0xffff,
        bits & 0xffff_ffff_ffff
    )
}

/// An exporter run within the runtime: the SDK exports from a thread of its own, where the
/// exporters' clients (tonic, hyper) would find no runtime for their timers and sockets.
#[derive(Debug)]
struct OnRuntime<E> {
    exporter: E,
    runtime: Handle,
}

impl<E: SpanExporter> SpanExporter for OnRuntime<E> {
    fn export(&self, batch: Vec<SpanData>) -> impl Future<Output = OTelSdkResult> + Send {
        Entered {
            runtime: &self.runtime,
            future: self.exporter.export(batch),
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        let _entered = self.runtime.enter();
        self.exporter.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        let _entered = self.runtime.enter();
        self.exporter.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.exporter.set_resource(resource);
    }
}

pin_project! {
    /// A future polled within the runtime's context.
    struct Entered<'a, F> {
        runtime: &'a Handle,
        #[pin]
        future: F,
    }
}

impl<F: Future> Future for Entered<'_, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let _entered = this.runtime.enter();
        this.future.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_uuids_are_version_4() {
        let uuid = random_uuid();
        let groups: Vec<&str> = uuid.split('-').collect();
        assert_eq!(
            groups.iter().map(|g| g.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
        assert!(groups[2].starts_with('4'), "{uuid}");
        assert!("89ab".contains(&groups[3][..1]), "{uuid}");
        assert_ne!(uuid, random_uuid());
    }
}
