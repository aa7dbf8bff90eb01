//! Logs and traces. Logs go to stderr as text or JSON, filtered by LOG_LEVEL. Built with the
//! `otel` feature and run with `OTEL_EXPORTER_OTLP_ENDPOINT` set, each decision is also a
//! trace span (`should_rate_limit`, with the backend call inside) exported over OTLP/gRPC.
//!
//! The request spans are at TRACE level and only the trace exporter listens at that level,
//! so without it they cost next to nothing.

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, fmt};

/// How log lines are written (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Keeps the trace exporter alive; dropping it flushes the spans still buffered.
pub struct Telemetry {
    #[cfg(feature = "otel")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        #[cfg(feature = "otel")]
        if let Some(provider) = self.provider.take() {
            let _ = provider.shutdown();
        }
    }
}

/// The Redis client's own warnings, unless LOG_LEVEL names its target: it warns once per
/// failed connection attempt (dozens a second while a Cluster master is down), where the
/// backend logs one line per event (a master switched, slots moved).
const REDIS_CLIENT: &str = "redis=error";

pub fn init(level: &str, format: LogFormat) -> Telemetry {
    use std::io::IsTerminal;
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
    let logs = logs.with_filter(filter).boxed();
    #[cfg(feature = "otel")]
    let (layers, provider) = match otel::layer() {
        Some((traces, provider)) => (vec![logs, traces], Some(provider)),
        None => (vec![logs], None),
    };
    #[cfg(not(feature = "otel"))]
    let layers = vec![logs];
    tracing_subscriber::registry().with(layers).init();
    Telemetry {
        #[cfg(feature = "otel")]
        provider,
    }
}

#[cfg(feature = "otel")]
mod otel {
    use opentelemetry::trace::TracerProvider;
    use opentelemetry_sdk::Resource;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use tracing_subscriber::filter::{LevelFilter, Targets};
    use tracing_subscriber::{Layer, Registry};

    type Boxed = Box<dyn Layer<Registry> + Send + Sync>;

    /// The OTLP trace layer, when `OTEL_EXPORTER_OTLP_ENDPOINT` is set.
    pub fn layer() -> Option<(Boxed, SdkTracerProvider)> {
        std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT")?;
        let exporter = match opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()
        {
            Ok(exporter) => exporter,
            Err(error) => {
                eprintln!("turnstile: OpenTelemetry exporter not started: {error}");
                return None;
            }
        };
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(Resource::builder().with_service_name("turnstile").build())
            .build();
        let layer = tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("turnstile"))
            .with_filter(Targets::new().with_target("turnstile", LevelFilter::TRACE))
            .boxed();
        Some((layer, provider))
    }
}
