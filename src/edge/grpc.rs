//! `ShouldRateLimit` at the gRPC edge: the request's one message read from its HTTP/2 body,
//! decided by [`RateLimiter::check`], and the answer framed, by a tower layer in front of
//! tonic's router, which still serves every other method (health, RLQS).
//!
//! Not tonic's generated service: every call is one small unary message, and tonic's general
//! path around it (router, streaming codec, per-call timer) costs more than the decision on
//! the memory backend (measured in BENCHMARKS.md). One deadline bounds the whole call
//! (`Deadline`). A call takes its place among the calls in flight only once its message has
//! arrived, after one among its peer's (`Caller`), so a client opening many streams or keeping
//! many calls waiting is refused past its share while others still find places. A costly
//! call (past `LIGHT_MESSAGE_BYTES`) also waits for one of a few `costly` places, so clients
//! of large messages cannot keep the serving threads from everyone else's calls.

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use http::{HeaderMap, HeaderName, HeaderValue, header};
use http_body::{Body as _, Frame};
use prost::Message;
use tokio::sync::Semaphore;
use tonic::Status;
use tonic::body::Body;
use tower::util::Oneshot;
use tower::{BoxError, Layer, Service, ServiceExt};

use crate::backend::Backend;
use crate::decision::deadline::{Deadline, grpc_timeout};
use crate::edge::pacemaker;
use crate::edge::peers::Caller;
use crate::service::RateLimiter;

/// The method this edge answers; the rest go to the inner service.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The gRPC headers this edge reads and writes, parsed once: a name given as text is
/// parsed and validated on every lookup or insert.
static GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");
static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");

/// A gRPC message's prefix: the compressed flag and the length (big-endian u32).
pub const PREFIX: usize = 5;

/// Largest message of a light call, which never waits for a place among the costly ones.
const LIGHT_MESSAGE_BYTES: usize = 8 << 10;

/// How many calls may be in flight, from their message's arrival to their answer.
#[derive(Clone)]
pub struct CallCaps {
    /// All calls in flight (none free: RESOURCE_EXHAUSTED at once).
    pub in_flight: Arc<Semaphore>,
    /// Most calls in flight from one peer address (past it: RESOURCE_EXHAUSTED at once).
    pub per_peer: usize,
    /// Costly calls being decided (waited for).
    pub costly: Arc<Semaphore>,
}

/// What answers every `ShouldRateLimit` call, shared by every connection.
pub struct CallHandler<B> {
    limiter: Arc<RateLimiter<B>>,
    max_message_bytes: usize,
    caps: CallCaps,
}

impl<B> CallHandler<B> {
    /// Answers `ShouldRateLimit` with `limiter`, messages of at most `max_message_bytes`,
    /// each call within its `caps`.
    pub fn new(limiter: Arc<RateLimiter<B>>, max_message_bytes: usize, caps: CallCaps) -> Self {
        CallHandler {
            limiter,
            max_message_bytes,
            caps,
        }
    }
}

/// The edge on one connection, whose calls all come from `caller`: a connection knows its
/// peer, so its calls need not carry it (only those for the inner service do, in their
/// extensions, for RLQS).
pub struct ShouldRateLimitLayer<B> {
    handler: Arc<CallHandler<B>>,
    caller: Caller,
}

impl<B> ShouldRateLimitLayer<B> {
    pub fn new(handler: Arc<CallHandler<B>>, caller: Caller) -> Self {
        ShouldRateLimitLayer { handler, caller }
    }
}

impl<S, B> Layer<S> for ShouldRateLimitLayer<B> {
    type Service = ShouldRateLimit<S, B>;

    fn layer(&self, inner: S) -> Self::Service {
        ShouldRateLimit {
            inner,
            handler: Arc::clone(&self.handler),
            caller: self.caller.clone(),
        }
    }
}

pub struct ShouldRateLimit<S, B> {
    inner: S,
    handler: Arc<CallHandler<B>>,
    caller: Caller,
}

impl<S: Clone, B> Clone for ShouldRateLimit<S, B> {
    fn clone(&self) -> Self {
        ShouldRateLimit {
            inner: self.inner.clone(),
            handler: Arc::clone(&self.handler),
            caller: self.caller.clone(),
        }
    }
}

type Answered = Pin<Box<dyn Future<Output = http::Response<CallBody>> + Send>>;

/// Always ready: this edge waits for nothing before a call, and readiness taken from the
/// inner service (a place among the calls in flight, say) would be held for calls that never
/// reach it. A call for the inner service gets a clone of it, readied for that call alone.
///
/// The request's body is the connection's own (not boxed, as the inner service takes it):
/// every call has one.
impl<S, B, R> Service<http::Request<R>> for ShouldRateLimit<S, B>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone,
    B: Backend,
    R: http_body::Body<Data = Bytes> + Send + 'static,
    R::Error: Into<BoxError>,
{
    type Response = http::Response<CallBody>;
    type Error = S::Error;
    type Future = Routed<Oneshot<S, http::Request<Body>>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<R>) -> Self::Future {
        if request.uri().path() != SHOULD_RATE_LIMIT {
            let mut request = request.map(Body::new);
            request.extensions_mut().insert(self.caller.clone());
            return Routed::Inner(Box::pin(self.inner.clone().oneshot(request)));
        }
        Routed::Here(Box::pin(
            Arc::clone(&self.handler).answer(request, self.caller.clone()),
        ))
    }
}

/// A call's answer: from the inner service (health and RLQS, rare enough to box), or from
/// this edge, which never fails: an error is a gRPC status in the answer.
pub enum Routed<F> {
    Inner(Pin<Box<F>>),
    Here(Answered),
}

impl<F, E> Future for Routed<F>
where
    F: Future<Output = Result<http::Response<Body>, E>>,
{
    type Output = Result<http::Response<CallBody>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Routed::Inner(inner) => inner
                .as_mut()
                .poll(cx)
                .map_ok(|response| response.map(CallBody::Other)),
            Routed::Here(answer) => answer.as_mut().poll(cx).map(Ok),
        }
    }
}

impl<B: Backend> CallHandler<B> {
    async fn answer<R>(
        self: Arc<Self>,
        request: http::Request<R>,
        caller: Caller,
    ) -> http::Response<CallBody>
    where
        R: http_body::Body<Data = Bytes>,
        R::Error: Into<BoxError>,
    {
        pacemaker::call_begins();
        let (parts, body) = request.into_parts();
        // The request timeout bounds every call, whatever its caller would wait.
        let longest = self.limiter.request_timeout();
        let timeout = parts
            .headers
            .get(&GRPC_TIMEOUT)
            .and_then(|value| value.to_str().ok())
            .and_then(grpc_timeout)
            .map_or(longest, |caller| caller.min(longest));
        let deadline = Deadline::for_call(timeout);
        let message = match deadline
            .bound(read_message(body, self.max_message_bytes))
            .await
        {
            Some(Ok(message)) => message,
            Some(Err(status)) => return status.into_http(),
            None => {
                return Status::deadline_exceeded(
                    "the request's message did not arrive, or its stream did not end, in time",
                )
                .into_http();
            }
        };
        let caps = &self.caps;
        let Some(_from_peer) = caller.call(caps.per_peer) else {
            return Status::resource_exhausted(format!(
                "{} calls in flight from {}, the most one peer address may have \
                 (--max-in-flight-per-peer)",
                caps.per_peer,
                caller.remote.ip()
            ))
            .into_http();
        };
        let Ok(_in_flight) = caps.in_flight.try_acquire() else {
            return Status::resource_exhausted("too many calls in flight").into_http();
        };
        let _costly = if message.len() > LIGHT_MESSAGE_BYTES {
            let Some(Ok(place)) = deadline.bound(caps.costly.acquire()).await else {
                return Status::deadline_exceeded(format!(
                    "a costly call (a message of {} bytes) found no place among the costly \
                     calls in progress in time",
                    message.len()
                ))
                .into_http();
            };
            Some(place)
        } else {
            None
        };
        let request = match RateLimitRequest::decode(message) {
            Ok(request) => request,
            Err(err) => {
                return Status::invalid_argument(format!("not a RateLimitRequest: {err}"))
                    .into_http();
            }
        };
        match self
            .limiter
            .check(&request, Some(deadline), &parts.headers)
            .await
        {
            Ok(response) => ok(frame(&response)),
            Err(status) => status.into_http(),
        }
    }
}

/// The body's one gRPC message (without its prefix), once the body has ended, or the status
/// to answer with. A unary call carries one message: bytes after it are refused, as a second
/// message would be ignored. Envoy ends the stream with the message's frame, so it waits for
/// nothing more; a client that leaves its stream open after the message waits until it ends
/// it (or the call's deadline), as gRPC servers do for a unary call.
async fn read_message<R>(body: R, max: usize) -> Result<Bytes, Status>
where
    R: http_body::Body<Data = Bytes>,
    R::Error: Into<BoxError>,
{
    let mut body = pin!(body);
    let mut buffered = BytesMut::new();
    let message = loop {
        let frame = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await;
        let data = match frame {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => data,
                // Request trailers carry nothing a decision reads.
                Err(_) => continue,
            },
            Some(Err(error)) => return Err(Status::from_error(error.into())),
            None => {
                return Err(Status::invalid_argument(format!(
                    "the request's body ended after {} bytes, before its message",
                    buffered.len()
                )));
            }
        };
        // Most messages arrive whole in one frame: no copy then.
        if buffered.is_empty()
            && let Some(message) = message_length(&data, max)?
        {
            only_message(data.len() - PREFIX - message)?;
            break data.slice(PREFIX..PREFIX + message);
        }
        buffered.extend_from_slice(&data);
        if let Some(message) = message_length(&buffered, max)? {
            only_message(buffered.len() - PREFIX - message)?;
            buffered.advance(PREFIX);
            break buffered.split_to(message).freeze();
        }
    };
    while !body.is_end_stream() {
        match std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
            Some(Ok(frame)) => only_message(frame.data_ref().map_or(0, Bytes::len))?,
            Some(Err(error)) => return Err(Status::from_error(error.into())),
            None => break,
        }
    }
    Ok(message)
}

/// Refuse `after` bytes following a unary call's message, unless there are none.
fn only_message(after: usize) -> Result<(), Status> {
    if after == 0 {
        return Ok(());
    }
    Err(Status::invalid_argument(format!(
        "a ShouldRateLimit call carries one message; {after} more bytes follow it"
    )))
}

/// The length of the message `data` starts with, once all of it is there.
fn message_length(data: &[u8], max: usize) -> Result<Option<usize>, Status> {
    let Some(prefix) = data.get(..PREFIX) else {
        return Ok(None);
    };
    match prefix[0] {
        0 => {}
        1 => {
            return Err(Status::unimplemented(
                "compressed requests are not accepted (send them with grpc-encoding identity)",
            ));
        }
        flag => {
            return Err(Status::invalid_argument(format!(
                "a gRPC message's compressed flag is 0 or 1, not {flag}"
            )));
        }
    }
    let length = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if length > max {
        return Err(Status::out_of_range(format!(
            "the request's message is {length} bytes, over the limit of {max} \
             (--max-message-bytes)"
        )));
    }
    Ok((data.len() - PREFIX >= length).then_some(length))
}

/// `message` as one gRPC message: its prefix, then its bytes.
fn frame(message: &impl Message) -> Bytes {
    let length = message.encoded_len();
    let mut framed = BytesMut::with_capacity(PREFIX + length);
    framed.put_u8(0);
    // An answer is far below 4 GiB: a few statuses and headers per descriptor.
    framed.put_u32(u32::try_from(length).unwrap_or(u32::MAX));
    message
        .encode(&mut framed)
        .expect("the buffer was sized to the message");
    framed.freeze()
}

/// An OK answer carrying `framed`.
fn ok(framed: Bytes) -> http::Response<CallBody> {
    let mut response = http::Response::new(CallBody::Message(framed));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    response
}

/// A call's body as it is answered: an OK answer's message, then the trailers saying OK;
/// nothing more (`Done`, also the body of an error answer, whose status is in its headers);
/// or the inner service's body. An enum, not a boxed body, since every call has one.
#[derive(Default)]
pub enum CallBody {
    Message(Bytes),
    Trailers,
    #[default]
    Done,
    Other(Body),
}

impl http_body::Body for CallBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        let frame = match this {
            CallBody::Message(message) => {
                let message = std::mem::take(message);
                *this = CallBody::Trailers;
                Frame::data(message)
            }
            CallBody::Trailers => {
                *this = CallBody::Done;
                let mut trailers = HeaderMap::with_capacity(1);
                trailers.insert(GRPC_STATUS.clone(), HeaderValue::from_static("0"));
                Frame::trailers(trailers)
            }
            CallBody::Done => return Poll::Ready(None),
            CallBody::Other(body) => return Pin::new(body).poll_frame(cx),
        };
        Poll::Ready(Some(Ok(frame)))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            CallBody::Other(body) => body.size_hint(),
            _ => http_body::SizeHint::default(),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            CallBody::Done => true,
            CallBody::Other(body) => body.is_end_stream(),
            CallBody::Message(_) | CallBody::Trailers => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_read_once_whole_and_refused_when_it_cannot_be() {
        let framed = |flag: u8, length: u32, body: &[u8]| {
            let mut data = vec![flag];
            data.extend_from_slice(&length.to_be_bytes());
            data.extend_from_slice(body);
            data
        };
        // Each row: what the body holds so far, and what reading it gives (a length once the
        // message is whole, or the status's code).
        type Row = (&'static str, Vec<u8>, Result<Option<usize>, tonic::Code>);
        let rows: [Row; 8] = [
            ("nothing yet", vec![], Ok(None)),
            ("part of the prefix", vec![0, 0, 0], Ok(None)),
            ("the prefix alone", framed(0, 3, b""), Ok(None)),
            ("part of the message", framed(0, 3, b"ab"), Ok(None)),
            ("the whole message", framed(0, 3, b"abc"), Ok(Some(3))),
            ("an empty message", framed(0, 0, b""), Ok(Some(0))),
            (
                "compressed",
                framed(1, 3, b"abc"),
                Err(tonic::Code::Unimplemented),
            ),
            (
                "an unknown flag",
                framed(7, 3, b"abc"),
                Err(tonic::Code::InvalidArgument),
            ),
        ];
        for (name, data, expected) in rows {
            let got = message_length(&data, 16).map_err(|status| status.code());
            assert_eq!(got, expected, "{name}");
        }
        let status = message_length(&framed(0, 17, b""), 16).unwrap_err();
        assert_eq!(status.code(), tonic::Code::OutOfRange);
        assert!(status.message().contains("17 bytes"), "{status:?}");
    }

    #[test]
    fn an_answer_is_its_framed_message_then_ok_trailers_then_nothing() {
        let response = envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse {
            overall_code: 1,
            ..Default::default()
        };
        let framed = frame(&response);
        assert_eq!(framed[0], 0);
        let length = u32::from_be_bytes([framed[1], framed[2], framed[3], framed[4]]) as usize;
        assert_eq!(length, framed.len() - PREFIX);
        assert_eq!(
            envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse::decode(
                &framed[PREFIX..]
            )
            .unwrap(),
            response
        );

        let mut answer = CallBody::Message(framed.clone());
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut next = || match Pin::new(&mut answer).poll_frame(&mut cx) {
            Poll::Ready(frame) => frame.map(Result::unwrap),
            Poll::Pending => panic!("an answer is never pending"),
        };
        assert_eq!(next().unwrap().into_data().unwrap(), framed);
        let trailers = next().unwrap().into_trailers().unwrap();
        assert_eq!(trailers.len(), 1);
        assert_eq!(trailers["grpc-status"], "0");
        assert!(next().is_none());
        assert!(answer.is_end_stream());
    }
}
