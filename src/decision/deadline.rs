//! When a caller stops waiting for its answer: one value carried from the gRPC edge (Envoy
//! sends its filter timeout as `grpc-timeout`) down to the Redis script, which, starting
//! later than it, charges nothing.
//!
//! One deadline instead of a timeout per layer: no layer waits for an answer nobody will
//! read, and no decision is charged for a caller that already gave up. A caller without a
//! deadline of its own gets the request timeout's. The Redis call timeout is not folded into
//! it: it bounds a call from when it is written, so that it measures Redis alone. It travels as a task-local because only the
//! edge sets it and only the backend at the bottom reads it; the decorators in between need
//! not carry it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::task::futures::TaskLocalFuture;
use tokio::time::Sleep;

/// An instant past which the answer is of no use to its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline(Instant);

tokio::task_local! {
    static CURRENT: Deadline;
}

/// What an answer needs, after the backend, to reach a caller before its deadline: this
/// plus a quarter of the caller's timeout (a busy machine delays timers and answers).
const ANSWER_MARGIN: Duration = Duration::from_millis(1);

/// Longer than any caller waits; what a timeout too large to add to an instant means.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

impl Deadline {
    pub fn at(instant: Instant) -> Deadline {
        Deadline(instant)
    }

    /// `timeout` from now.
    pub fn after(timeout: Duration) -> Deadline {
        let now = Instant::now();
        Deadline(
            now.checked_add(timeout)
                .or_else(|| now.checked_add(FOREVER))
                .unwrap_or(now),
        )
    }

    /// The deadline for deciding a call whose caller waits `timeout` in all: earlier by
    /// what the answer needs to get back.
    pub fn for_call(timeout: Duration) -> Deadline {
        Deadline::after(timeout.saturating_sub(ANSWER_MARGIN + timeout / 4))
    }

    pub fn instant(self) -> Instant {
        self.0
    }

    /// Time left (zero once past).
    pub fn remaining(self) -> Duration {
        self.0.saturating_duration_since(Instant::now())
    }

    /// The deadline of the decision this task is taking, if its caller set one.
    pub fn current() -> Option<Deadline> {
        CURRENT.try_with(|deadline| *deadline).ok()
    }

    /// Run `work` as a decision due by this deadline (for [`Deadline::current`]), without a
    /// timer: the backend alone decides what being late means.
    pub fn scope<F: Future>(self, work: F) -> TaskLocalFuture<Deadline, F> {
        CURRENT.scope(self, work)
    }

    /// Run `work` as a decision due by this deadline, and give up on it then (`None`).
    pub fn bound<F: Future>(self, work: F) -> Bound<F> {
        Bound {
            work: self.scope(work),
            timer: None,
            due: self.0,
        }
    }
}

pin_project_lite::pin_project! {
    /// [`Deadline::bound`]'s future. Written out rather than an `async fn` because the
    /// compiler keeps an async fn's argument and the future made of it side by side: the
    /// backend's future then took three times its size here, and every layer above it moved
    /// the whole (a call's futures came to 4.8 KB, copied on each move).
    pub struct Bound<F: Future> {
        #[pin]
        work: TaskLocalFuture<Deadline, F>,
        // Set once the work is not done at its first poll: work that is (the memory
        // backend's decisions) needs no timer, which cost about a third of such a decision.
        #[pin]
        timer: Option<Sleep>,
        due: Instant,
    }
}

impl<F: Future> Future for Bound<F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if let Poll::Ready(output) = this.work.poll(cx) {
            return Poll::Ready(Some(output));
        }
        if this.timer.is_none() {
            this.timer
                .set(Some(tokio::time::sleep_until((*this.due).into())));
        }
        if let Some(timer) = this.timer.as_pin_mut() {
            std::task::ready!(timer.poll(cx));
        }
        Poll::Ready(None)
    }
}

/// A `grpc-timeout` header's value: digits and a unit letter (gRPC over HTTP/2).
pub fn grpc_timeout(text: &str) -> Option<Duration> {
    let (amount, unit) = text.split_at(text.len().checked_sub(1)?);
    let amount: u64 = amount.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount.checked_mul(3_600)?),
        "M" => Duration::from_secs(amount.checked_mul(60)?),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_are_read_in_every_unit() {
        let rows = [
            ("2H", Some(Duration::from_secs(7_200))),
            ("3M", Some(Duration::from_secs(180))),
            ("4S", Some(Duration::from_secs(4))),
            ("20m", Some(Duration::from_millis(20))),
            ("250u", Some(Duration::from_micros(250))),
            ("1n", Some(Duration::from_nanos(1))),
            ("", None),
            ("m", None),
            ("12x", None),
            ("-1m", None),
            ("99999999999999999999H", None),
        ];
        for (text, expected) in rows {
            assert_eq!(grpc_timeout(text), expected, "{text:?}");
        }
    }

    #[test]
    fn a_huge_timeout_is_far_away_not_a_panic() {
        let deadline = Deadline::after(Duration::MAX);
        assert!(deadline.remaining() > Duration::from_secs(3600));
        assert!(Deadline::for_call(Duration::MAX).remaining() > Duration::from_secs(3600));
    }

    #[test]
    fn a_call_keeps_a_quarter_and_a_millisecond_to_answer() {
        let deadline = Deadline::for_call(Duration::from_millis(100));
        let left = deadline.remaining();
        assert!(left <= Duration::from_millis(74), "{left:?}");
        assert!(left > Duration::from_millis(60), "{left:?}");
        assert_eq!(
            Deadline::for_call(Duration::from_micros(500)).remaining(),
            Duration::ZERO
        );
    }

    #[tokio::test]
    async fn bound_gives_up_at_the_deadline() {
        let past = Deadline::at(Instant::now() - Duration::from_millis(1));
        assert_eq!(past.bound(std::future::pending::<()>()).await, None);
        let soon = Deadline::after(Duration::from_secs(5));
        assert_eq!(
            soon.bound(async { Deadline::current() }).await,
            Some(Some(soon))
        );
        // Not done at its first poll: timed from then, and done in time.
        let waited = soon.bound(async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            Deadline::current()
        });
        assert_eq!(waited.await, Some(Some(soon)));
        let never = Deadline::after(Duration::from_millis(20)).bound(std::future::pending::<()>());
        assert_eq!(never.await, None);
    }

    /// Every layer above the backend moves its future whole: bounding it must not take
    /// several times its size, as an `async fn` keeping its argument beside the future made
    /// of it did (2.4 KB of a Redis call's 4.8).
    #[test]
    fn bound_takes_little_more_room_than_its_work() {
        let payload = [0u8; 1024];
        let work = async move { payload.len() };
        let work_size = std::mem::size_of_val(&work);
        let bound = Deadline::after(Duration::from_secs(1)).bound(work);
        let overhead = std::mem::size_of_val(&bound) - work_size;
        assert!(overhead < 256, "{overhead} bytes on top of {work_size}");
    }
}
