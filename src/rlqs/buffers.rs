//! What an RLQS stream's reports make the server hold, counted before it is held.
//!
//! tonic reads a stream's messages as they arrive: once a message's prefix declares its
//! length, it sets aside that many bytes, fills them as the bytes come, and keeps the buffer
//! (grown to the stream's largest report) for the stream's life. Flow control does not bound
//! that, since the bytes are read as soon as they come. So each stream's request body is
//! wrapped here: every prefix is read on its way in, and the stream's charge grows to the
//! largest message declared before tonic sets anything aside; a message past what all streams
//! together may hold ends the stream with RESOURCE_EXHAUSTED.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tonic::Status;
use tonic::body::Body;
use tonic::server::NamedService;
use tower::Service;

use super::budget::{Budget, Charge};
use crate::edge::grpc::PREFIX;

/// Where a body's length-prefixed messages stand.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Framing {
    /// Inside a prefix, `seen` of its bytes read.
    Prefix { bytes: [u8; PREFIX], seen: usize },
    /// Inside a message, `left` of its bytes still to come.
    Message { left: usize },
}

impl Default for Framing {
    fn default() -> Framing {
        Framing::Prefix {
            bytes: [0; PREFIX],
            seen: 0,
        }
    }
}

impl Framing {
    /// Read `data`, the body's next bytes; the largest message (prefix included) whose prefix
    /// it completes, 0 if none.
    fn read(&mut self, mut data: &[u8]) -> usize {
        let mut largest = 0;
        while !data.is_empty() {
            match self {
                Framing::Prefix { bytes, seen } => {
                    let n = (PREFIX - *seen).min(data.len());
                    bytes[*seen..*seen + n].copy_from_slice(&data[..n]);
                    *seen += n;
                    data = &data[n..];
                    if *seen == PREFIX {
                        let left = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);
                        let left = left as usize;
                        largest = largest.max(PREFIX + left);
                        *self = match left {
                            0 => Framing::default(),
                            left => Framing::Message { left },
                        };
                    }
                }
                Framing::Message { left } => {
                    let n = (*left).min(data.len());
                    *left -= n;
                    data = &data[n..];
                    if *left == 0 {
                        *self = Framing::default();
                    }
                }
            }
        }
        largest
    }
}

/// Grow a stream's charge against the buffers' budget to `bytes` (the size of `what`), or
/// the status that ends the stream.
pub fn hold(charge: &mut Charge, what: &str, bytes: usize) -> Result<(), Status> {
    if charge.grow_to(bytes) {
        return Ok(());
    }
    Err(Status::resource_exhausted(format!(
        "{what} of {bytes} bytes would take the RLQS streams' buffers past {} bytes \
         (--rlqs-max-buffer-bytes)",
        charge.budget().max()
    )))
}

/// A stream's request body, its messages charged as their prefixes arrive.
struct ChargedBody {
    inner: Body,
    framing: Framing,
    charge: Charge,
    /// Messages past this are refused by tonic itself (`--max-message-bytes`), not charged.
    max_message: usize,
}

impl http_body::Body for ChargedBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
        if let Some(Ok(data)) = &frame
            && let Some(data) = data.data_ref()
        {
            let declared = this.framing.read(data);
            if declared <= PREFIX + this.max_message
                && let Err(refused) = hold(&mut this.charge, "a report", declared)
            {
                return Poll::Ready(Some(Err(refused)));
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The RLQS service, its streams' reports charged against `budget`.
#[derive(Clone)]
pub struct Charged<S> {
    inner: S,
    budget: Arc<Budget>,
    max_message: usize,
}

impl<S> Charged<S> {
    pub fn new(inner: S, budget: Arc<Budget>, max_message: usize) -> Charged<S> {
        Charged {
            inner,
            budget,
            max_message,
        }
    }
}

impl<S: NamedService> NamedService for Charged<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Charged<S>
where
    S: Service<http::Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> S::Future {
        let (budget, max_message) = (self.budget.clone(), self.max_message);
        self.inner.call(request.map(|inner| {
            Body::new(ChargedBody {
                inner,
                framing: Framing::default(),
                charge: Charge::new(budget),
                max_message,
            })
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefix(length: u32) -> Vec<u8> {
        let mut bytes = vec![0];
        bytes.extend(length.to_be_bytes());
        bytes
    }

    #[test]
    fn the_largest_message_is_known_from_its_prefix() {
        let message = |length: u32| {
            let mut bytes = prefix(length);
            bytes.resize(PREFIX + length as usize, 7);
            bytes
        };
        let two = [message(3), message(10)].concat();
        let split_prefix = prefix(1_000);
        // Rows: the body's frames; the largest message each frame declares.
        type Row = (&'static str, Vec<Vec<u8>>, Vec<usize>);
        let rows: [Row; 6] = [
            ("one message, one frame", vec![message(10)], vec![15]),
            ("two messages, one frame", vec![two], vec![15]),
            (
                "a prefix split over frames",
                vec![split_prefix[..2].to_vec(), split_prefix[2..].to_vec()],
                vec![0, 1_005],
            ),
            (
                "a message over three frames, then another",
                vec![
                    message(6)[..4].to_vec(),
                    message(6)[4..8].to_vec(),
                    [&message(6)[8..], &prefix(2)[..]].concat(),
                ],
                vec![0, 11, 7],
            ),
            (
                "an empty message, then a declared one",
                vec![[message(0), prefix(4_000_000)].concat()],
                vec![4_000_005],
            ),
            (
                "only a prefix, its bytes never sent",
                vec![prefix(u32::MAX)],
                vec![PREFIX + u32::MAX as usize],
            ),
        ];
        for (name, frames, declared) in rows {
            let mut framing = Framing::default();
            let seen: Vec<usize> = frames.iter().map(|frame| framing.read(frame)).collect();
            assert_eq!(seen, declared, "{name}");
        }
    }
}
