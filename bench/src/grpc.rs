//! ShouldRateLimit over a bare HTTP/2 connection (the `h2` crate), without tonic's client
//! or hyper's.
//!
//! A load generator must cost far less per call than the service it measures, or on cores it
//! shares with that service it measures itself. Through tonic and hyper a call also passes a
//! dispatch channel, a task hyper spawns to stream its body, and buffers and header maps
//! built for any gRPC call; here it is what the wire needs: one HEADERS frame with two
//! headers, one DATA frame holding the length-prefixed message, then the answer's DATA
//! frames and the trailers' `grpc-status`. gRPC errors are read from the same headers tonic
//! reads them from, so a refusal, an error and a transport failure are told apart as before.

use std::time::Duration;

use anyhow::Context;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use prost::Message;

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
/// gRPC's length prefix: a compression flag (always 0 here) and a 4-byte length.
const PREFIX: usize = 5;

/// One HTTP/2 connection to a RateLimitService; clones share it. A call on a connection
/// that failed is an error, counted as such; nothing reconnects.
#[derive(Clone)]
pub struct Connection {
    send: h2::client::SendRequest<Bytes>,
    uri: http::Uri,
}

/// A connection to `target` (`host:port`, or `http://host:port`).
pub async fn connect(target: &str) -> anyhow::Result<Connection> {
    let origin = super::target_uri(target);
    let parsed: http::Uri = origin
        .parse()
        .with_context(|| format!("invalid target {target}"))?;
    let address = match (parsed.scheme_str(), parsed.authority()) {
        (Some("http"), Some(authority)) if authority.port().is_some() => authority.to_string(),
        _ => anyhow::bail!("target {target}: expected host:port or http://host:port"),
    };
    let uri: http::Uri = format!("http://{address}{PATH}")
        .parse()
        .with_context(|| format!("invalid target {target}"))?;
    let handshake = async {
        let tcp = tokio::net::TcpStream::connect(&address).await?;
        tcp.set_nodelay(true)?;
        // Streams beyond the server's limit are refused, and a server may close a connection
        // that keeps opening them: until its SETTINGS say how many, assume a common 100.
        // Every answer carries one small DATA frame, which h2 budgets against the connection's
        // window while it waits for a worker to read it: a window of a few MiB keeps hundreds
        // of answers buffered within budget (h2 would otherwise close the connection).
        let (send, connection) = h2::client::Builder::new()
            .initial_max_send_streams(100)
            .initial_connection_window_size(4 << 20)
            .handshake(tcp)
            .await
            .map_err(std::io::Error::other)?;
        // The connection's task ends with the connection; its error reaches every call.
        tokio::spawn(async move { drop(connection.await) });
        std::io::Result::Ok(send)
    };
    let send = tokio::time::timeout(Duration::from_secs(5), handshake)
        .await
        .map_err(|_| anyhow::anyhow!("connecting to {origin} timed out"))?
        .with_context(|| format!("cannot connect to {origin}"))?;
    Ok(Connection { send, uri })
}

fn unavailable(error: h2::Error) -> tonic::Status {
    tonic::Status::unavailable(error.to_string())
}

/// The generator's own client.
impl super::Client for Connection {
    async fn call(
        &mut self,
        request: RateLimitRequest,
    ) -> Result<RateLimitResponse, tonic::Status> {
        let head = http::Request::post(self.uri.clone())
            .header(http::header::CONTENT_TYPE, "application/grpc")
            .header(http::header::TE, "trailers")
            .body(())
            .map_err(|e| tonic::Status::internal(e.to_string()))?;
        let length = request.encoded_len();
        let mut body = BytesMut::with_capacity(PREFIX + length);
        body.put_u8(0);
        body.put_u32(length as u32);
        request
            .encode(&mut body)
            .map_err(|e| tonic::Status::internal(e.to_string()))?;

        std::future::poll_fn(|cx| self.send.poll_ready(cx))
            .await
            .map_err(unavailable)?;
        let (answer, mut stream) = self.send.send_request(head, false).map_err(unavailable)?;
        stream.send_data(body.freeze(), true).map_err(unavailable)?;
        let (head, mut body) = answer.await.map_err(unavailable)?.into_parts();
        if head.status != http::StatusCode::OK {
            return Err(tonic::Status::unknown(format!("HTTP {}", head.status)));
        }
        // A trailers-only answer (an error) carries its status in the headers.
        if let Some(status) = tonic::Status::from_header_map(&head.headers) {
            return Err(if status.code() == tonic::Code::Ok {
                tonic::Status::internal("OK without a message")
            } else {
                status
            });
        }
        let mut message = BytesMut::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.map_err(unavailable)?;
            // Received bytes count against the windows until released.
            let _ = body.flow_control().release_capacity(chunk.len());
            message.extend_from_slice(&chunk);
        }
        let trailers = body.trailers().await.map_err(unavailable)?;
        match trailers.as_ref().and_then(tonic::Status::from_header_map) {
            Some(status) if status.code() == tonic::Code::Ok => decode(message),
            Some(status) => Err(status),
            None => Err(tonic::Status::internal("an answer without grpc-status")),
        }
    }
}

/// The one length-prefixed, uncompressed message of an answer's body.
fn decode(mut body: BytesMut) -> Result<RateLimitResponse, tonic::Status> {
    let framing = || tonic::Status::internal("an answer that is not one gRPC message");
    if body.len() < PREFIX || body[0] != 0 {
        return Err(framing());
    }
    body.advance(1);
    let length = body.get_u32() as usize;
    if body.len() != length {
        return Err(framing());
    }
    RateLimitResponse::decode(body).map_err(|e| tonic::Status::internal(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_body_is_exactly_one_uncompressed_message() {
        let response = RateLimitResponse {
            overall_code: 2,
            ..Default::default()
        };
        let framed = |flag: u8, length: usize, message: &[u8]| {
            let mut body = BytesMut::new();
            body.put_u8(flag);
            body.put_u32(length as u32);
            body.extend_from_slice(message);
            body
        };
        let bytes = response.encode_to_vec();
        let cases = [
            (framed(0, bytes.len(), &bytes), true),
            (framed(1, bytes.len(), &bytes), false),
            (framed(0, bytes.len() + 1, &bytes), false),
            (BytesMut::from(&[0u8, 0, 0][..]), false),
        ];
        for (body, decodes) in cases {
            let decoded = decode(body.clone());
            assert_eq!(decoded.is_ok(), decodes, "{body:?}");
            if decodes {
                assert_eq!(decoded.unwrap(), response);
            }
        }
    }
}
