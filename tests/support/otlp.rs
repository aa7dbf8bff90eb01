//! An OTLP trace receiver run by the test, as a collector would be: the collector's gRPC
//! `TraceService` and OTLP/HTTP's `POST /v1/traces` (protobuf), each on a free loopback
//! port, keeping every span either receives. Its tasks end when it drops.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::status;
use prost::Message;
use tokio::task::JoinHandle;

/// One span as received, its ids as hex and its attributes as text.
#[derive(Debug, Clone)]
pub struct Span {
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub attributes: HashMap<String, String>,
    /// The attributes of the resource that sent it (service.name ...).
    pub resource: HashMap<String, String>,
    /// Whether the span's status is ERROR.
    pub error: bool,
    /// Which of the receiver's ports it came in on: "grpc" or "http".
    pub protocol: &'static str,
}

#[derive(Default)]
struct Received {
    spans: Mutex<Vec<Span>>,
    /// Export requests, spans or not.
    exports: Mutex<usize>,
}

impl Received {
    fn keep(&self, request: ExportTraceServiceRequest, protocol: &'static str) {
        *self.exports.lock().unwrap() += 1;
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.resource_spans {
            let resource = resource_spans
                .resource
                .map(|r| attributes(&r.attributes))
                .unwrap_or_default();
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.push(Span {
                        name: span.name,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        attributes: attributes(&span.attributes),
                        error: span
                            .status
                            .is_some_and(|status| status.code == status::StatusCode::Error as i32),
                        resource: resource.clone(),
                        protocol,
                    });
                }
            }
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attributes(pairs: &[KeyValue]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|pair| {
            let value = match pair.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Value::StringValue(s)) => s.clone(),
                Some(Value::IntValue(i)) => i.to_string(),
                Some(Value::BoolValue(b)) => b.to_string(),
                Some(Value::DoubleValue(d)) => d.to_string(),
                other => format!("{other:?}"),
            };
            (pair.key.clone(), value)
        })
        .collect()
}

pub struct Receiver {
    /// Where OTLP/gRPC exports go (OTEL_EXPORTER_OTLP_ENDPOINT=http://<grpc>).
    pub grpc: SocketAddr,
    /// Where OTLP/HTTP exports go (OTEL_EXPORTER_OTLP_ENDPOINT=http://<http>).
    pub http: SocketAddr,
    received: Arc<Received>,
    tasks: Vec<JoinHandle<()>>,
}

#[derive(Clone)]
struct Grpc(Arc<Received>);

#[tonic::async_trait]
impl TraceService for Grpc {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.keep(request.into_inner(), "grpc");
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

async fn http_export(State(received): State<Arc<Received>>, body: Bytes) -> Response {
    match ExportTraceServiceRequest::decode(body) {
        Ok(request) => {
            received.keep(request, "http");
            (
                [(header::CONTENT_TYPE, "application/x-protobuf")],
                ExportTraceServiceResponse::default().encode_to_vec(),
            )
                .into_response()
        }
        Err(error) => (StatusCode::BAD_REQUEST, error.to_string()).into_response(),
    }
}

impl Receiver {
    pub async fn start() -> Receiver {
        let received = Arc::new(Received::default());
        let grpc_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (grpc, http) = (
            grpc_listener.local_addr().unwrap(),
            http_listener.local_addr().unwrap(),
        );
        let service = TraceServiceServer::new(Grpc(Arc::clone(&received)));
        let grpc_task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(grpc_listener))
                .await
                .unwrap();
        });
        let router = axum::Router::new()
            .route("/v1/traces", axum::routing::post(http_export))
            .with_state(Arc::clone(&received));
        let http_task = tokio::spawn(async move {
            axum::serve(http_listener, router).await.unwrap();
        });
        Receiver {
            grpc,
            http,
            received,
            tasks: vec![grpc_task, http_task],
        }
    }

    pub fn spans(&self) -> Vec<Span> {
        self.received.spans.lock().unwrap().clone()
    }

    /// Export requests received, whatever they held.
    pub fn exports(&self) -> usize {
        *self.received.exports.lock().unwrap()
    }

    /// The spans once at least `count` have arrived; panics after `within`.
    pub async fn wait_for_spans(&self, count: usize, within: Duration) -> Vec<Span> {
        let deadline = Instant::now() + within;
        loop {
            let spans = self.spans();
            if spans.len() >= count {
                return spans;
            }
            assert!(
                Instant::now() < deadline,
                "{} spans arrived within {within:?}, expected {count}",
                spans.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}
