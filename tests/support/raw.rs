//! gRPC calls with bodies as they are on the wire, over a raw HTTP/2 connection: what the
//! generated clients cannot send (a message never finished, a bad prefix, a stall).

use std::time::Duration;

use super::turnstile::Turnstile;

/// A request body as bytes on the wire: `data`, then `later` in a frame of its own, then the
/// end of the stream, or (`stall`) nothing more, ever.
#[derive(Default)]
pub struct RawBody {
    pub data: Option<bytes::Bytes>,
    pub later: Option<bytes::Bytes>,
    pub stall: bool,
}

impl http_body::Body for RawBody {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        match self.data.take().or_else(|| self.later.take()) {
            Some(data) => std::task::Poll::Ready(Some(Ok(http_body::Frame::data(data)))),
            None if self.stall => std::task::Poll::Pending,
            None => std::task::Poll::Ready(None),
        }
    }
}

/// A raw HTTP/2 connection to turnstile's gRPC port, and the task driving it.
pub async fn raw_connection(
    t: &Turnstile,
) -> (
    hyper::client::conn::http2::SendRequest<RawBody>,
    tokio::task::JoinHandle<hyper::Result<()>>,
) {
    let tcp = tokio::net::TcpStream::connect(t.grpc).await.unwrap();
    let (send, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    (send, tokio::spawn(connection))
}

/// A gRPC request for the method at `path`, with the caller's `grpc_timeout` and `body` as
/// it is.
pub fn raw_request(path: &str, grpc_timeout: &str, body: RawBody) -> http::Request<RawBody> {
    http::Request::post(format!("http://turnstile{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", grpc_timeout)
        .body(body)
        .unwrap()
}

/// Call the gRPC method at `path` over `send` with `body` as it is and the caller's
/// `grpc_timeout`; its gRPC status, from the headers (trailers-only) or the trailers.
pub async fn raw_call(
    mut send: hyper::client::conn::http2::SendRequest<RawBody>,
    path: &str,
    grpc_timeout: &str,
    body: RawBody,
) -> tonic::Status {
    use http_body::Body as _;
    let request = raw_request(path, grpc_timeout, body);
    tokio::time::timeout(Duration::from_secs(5), async {
        let response = send.send_request(request).await.unwrap();
        let (parts, mut body) = response.into_parts();
        let mut found = parts.headers;
        while let Some(frame) =
            std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx)).await
        {
            if let Ok(trailers) = frame.unwrap().into_trailers() {
                found.extend(trailers);
            }
        }
        tonic::Status::from_header_map(&found).expect("a grpc-status")
    })
    .await
    .expect("an answer within 5 s")
}

/// A gRPC message's framing: the compressed flag, the length, the body.
pub fn framed(flag: u8, length: usize, body: &[u8]) -> bytes::Bytes {
    let mut data = vec![flag];
    data.extend_from_slice(&(length as u32).to_be_bytes());
    data.extend_from_slice(body);
    bytes::Bytes::from(data)
}
