//! Requests that arrive together share script calls, and calls are timed by Redis alone.
//!
//! A script call's fixed cost dwarfs one decision's, so each lane (the server, or one
//! Cluster slot) of a runtime's connections (`threads`) has at most `connections` calls in
//! flight, and requests that arrive meanwhile go together in the next one; an idle lane waits
//! for no timer. A call is timed from when it is written, on the runtime that reads its
//! reply: [`BackendError::Timeout`] is evidence against Redis, while a request whose wait ran
//! out in this queue, or a call whose runtime could not run, is [`BackendError::Late`].
//! Calls are bounded in hits and bytes (`MAX_CALL_HITS`, `MAX_CALL_BYTES`), and light
//! requests (`LIGHT_HITS`, `LIGHT_BYTES`) go ahead of costly ones but every other call, so a
//! client of costly requests mostly delays its own (measured in BENCHMARKS.md).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use ::redis::cluster_routing::Slot;
use tokio::runtime::Handle;
use tokio::sync::oneshot;

use super::Shared;
use super::mailbox::{Mailbox, Post, RequestAnswer};
use super::script::{self, Call, Part, Reply};
use super::threads::serving_thread;
use crate::algorithm::Micros;
use crate::backend::lag::Lag;
use crate::decision::BackendError;
use crate::decision::deadline::Deadline;

/// Most hits, and bytes of keys and permits, one call carries: a request with more goes alone.
const MAX_CALL_HITS: usize = 256;
const MAX_CALL_BYTES: usize = 64 << 10;
/// A request with at most this many hits and bytes is light: sent ahead of the others.
const LIGHT_HITS: usize = 8;
const LIGHT_BYTES: usize = 1 << 10;
/// Most requests, and hits, queued in one lane; past them a request fails at once
/// ([`BackendError::Overloaded`]): a lane that far behind could not answer it in time.
const MAX_QUEUED: usize = 4_096;
const MAX_QUEUED_HITS: usize = 65_536;
/// How long past its own bound a caller waits for a written call's answer, which the I/O
/// runtime gives by then unless it is itself stuck.
const GRACE: Duration = Duration::from_millis(5);

/// Every lane of a backend, and how they are bounded.
pub(super) struct Lanes {
    /// Requests per call at most (1: no coalescing).
    batch: usize,
    /// Calls in flight per lane at most.
    in_flight: usize,
    single: Arc<Lane>,
    /// Made on first use; a Cluster has at most 16 384 slots.
    slots: Mutex<HashMap<Slot, Arc<Lane>>>,
    /// How late its runtime runs (made on it).
    pub(super) lag: Lag,
}

impl Lanes {
    pub(super) fn new(batch: usize, connections: usize) -> Lanes {
        let batch = batch.max(1);
        Lanes {
            batch,
            // Without coalescing every request is its own call, sent at once.
            in_flight: if batch == 1 {
                usize::MAX
            } else {
                connections.max(1)
            },
            single: Arc::default(),
            slots: Mutex::default(),
            lag: Lag::start(),
        }
    }

    fn lane(&self, slot: Option<Slot>) -> Arc<Lane> {
        match slot {
            None => Arc::clone(&self.single),
            Some(slot) => Arc::clone(lock(&self.slots).entry(slot).or_default()),
        }
    }
}

#[derive(Default)]
struct Lane {
    queue: Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    /// Light requests, in order of arrival.
    light: VecDeque<Request>,
    /// The others, in order of arrival.
    heavy: VecDeque<Request>,
    /// The next call starts with `heavy`.
    heavy_first: bool,
    /// Hits of the waiting requests.
    hits: usize,
    in_flight: usize,
}

impl Queue {
    fn len(&self) -> usize {
        self.light.len() + self.heavy.len()
    }

    fn is_empty(&self) -> bool {
        self.light.is_empty() && self.heavy.is_empty()
    }

    fn line(&mut self, request: &Request) -> &mut VecDeque<Request> {
        let part = &request.part;
        if part.len() <= LIGHT_HITS && part.bytes() <= LIGHT_BYTES {
            &mut self.light
        } else {
            &mut self.heavy
        }
    }

    fn push_back(&mut self, request: Request) {
        self.hits += request.part.len();
        self.line(&request).push_back(request);
    }

    /// Back at the head of its line (a request to send again).
    fn push_front(&mut self, request: Request) {
        self.hits += request.part.len();
        self.line(&request).push_front(request);
    }
}

/// A request on its way: queued, then in a call.
struct Request {
    part: Part,
    at: Option<Micros>,
    /// When its caller stops waiting (none for a refund: it must apply).
    deadline: Option<Instant>,
    /// Bound on the call it goes in, from when that call is written.
    bound: Duration,
    /// When its call was written.
    written: Arc<Mutex<Option<Instant>>>,
    answer: oneshot::Sender<RequestAnswer>,
    /// Where the answer goes: its caller's thread's mailbox, if it has one.
    mailbox: Option<Arc<Mailbox>>,
    /// Sent again once already, after Redis' clock turned out ahead of the estimate.
    retried: bool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Decide `part` in the lane of `slot` (None: the one server). `deadline` is when the caller
/// stops waiting; `bound` bounds the call from when it is written.
pub(super) async fn call(
    shared: &Arc<Shared>,
    slot: Option<Slot>,
    part: Part,
    at: Option<Micros>,
    deadline: Option<Deadline>,
    bound: Duration,
) -> Result<Vec<Reply>, BackendError> {
    let deadline = deadline.map(Deadline::instant);
    let lanes = &shared.lanes;
    let lane = lanes.lane(slot);
    let until = deadline.unwrap_or_else(|| Instant::now() + bound);
    let (answer, mut reply) = oneshot::channel();
    let written = Arc::new(Mutex::new(None));
    let hits = part.len();
    let here = serving_thread();
    let on_own = here.as_ref().is_some_and(|h| h.id() == shared.runtime.id());
    let request = Request {
        part,
        at,
        deadline,
        bound,
        written: Arc::clone(&written),
        answer,
        // Answered on this thread, a request needs no mailbox.
        mailbox: if on_own { None } else { Mailbox::here() },
        retried: false,
    };
    let slot_free = {
        let mut queue = lock(&lane.queue);
        if queue.len() >= MAX_QUEUED || queue.hits + hits > MAX_QUEUED_HITS {
            return Err(BackendError::Overloaded);
        }
        queue.push_back(request);
        let free = queue.in_flight < lanes.in_flight;
        if free {
            queue.in_flight += 1;
        }
        free
    };
    if slot_free {
        start(shared, lane, here);
    }
    let lost = || Err(BackendError::Unavailable("a Redis call was lost".into()));
    if let Ok(answer) = tokio::time::timeout_at(until.into(), &mut reply).await {
        return answer.unwrap_or_else(|_| lost());
    }
    // Not yet written: the time went in the queue. Dropping `reply` takes it off.
    let Some(sent) = *lock(&written) else {
        return Err(BackendError::Late);
    };
    match tokio::time::timeout_at((sent + bound + GRACE).into(), &mut reply).await {
        Ok(answer) => answer.unwrap_or_else(|_| lost()),
        Err(_) => {
            // The answer may be in this thread's mailbox, rung in the same turn as this
            // timer: the task that empties it goes first.
            tokio::task::yield_now().await;
            match reply.try_recv() {
                Ok(answer) => answer,
                // Its runtime did not time its own call: it could not run.
                Err(_) => Err(BackendError::Late),
            }
        }
    }
}

/// Start a call in `lane` (its call slot taken) on its own runtime: from a thread serving
/// gRPC (`here`, a current-thread runtime), once that thread has run the tasks it already had
/// (the rest of the requests it read with this one), elsewhere at once: started at once, a
/// call would carry the first request alone and the others would wait for its round trip.
/// The wait is for no timer, only for work already on the thread.
fn start(shared: &Arc<Shared>, lane: Arc<Lane>, here: Option<Handle>) {
    let runtime = &shared.runtime;
    match here {
        // Its tasks run in turn: the call's goes after those already there.
        Some(here) if here.id() == runtime.id() => {
            here.spawn(drive(Arc::clone(shared), lane));
        }
        // Run, or dropped unrun when its runtime shuts down, the task drops `start`.
        Some(here) => {
            let start = Start(Some((Arc::clone(shared), lane)));
            here.spawn(async move { drop(start) });
        }
        None => {
            runtime.spawn(drive(Arc::clone(shared), lane));
        }
    }
}

/// A lane's call to start on its own runtime when this is dropped, however that happens.
struct Start(Option<(Arc<Shared>, Arc<Lane>)>);

impl Drop for Start {
    fn drop(&mut self) {
        if let Some((shared, lane)) = self.0.take() {
            let runtime = shared.runtime.clone();
            runtime.spawn(drive(shared, lane));
        }
    }
}

/// The next call's requests, light ones first but in every other call: up to `batch` of
/// them, `MAX_CALL_HITS` hits and `MAX_CALL_BYTES` bytes (at least one request), all deciding
/// at the same time.
fn take(queue: &mut Queue, batch: usize) -> Vec<Request> {
    let mut taken: Vec<Request> = Vec::new();
    let (mut hits, mut bytes) = (0, 0);
    let Queue {
        light,
        heavy,
        heavy_first,
        ..
    } = queue;
    let lines = if *heavy_first {
        [heavy, light]
    } else {
        [light, heavy]
    };
    *heavy_first = !*heavy_first;
    for line in lines {
        while let Some(next) = line.front() {
            if let Some(first) = taken.first() {
                let full = taken.len() >= batch
                    || hits + next.part.len() > MAX_CALL_HITS
                    || bytes + next.part.bytes() > MAX_CALL_BYTES;
                if full || next.at != first.at {
                    break;
                }
            }
            let Some(next) = line.pop_front() else {
                break;
            };
            hits += next.part.len();
            bytes += next.part.bytes();
            taken.push(next);
        }
    }
    queue.hits -= hits;
    taken
}

/// One of a lane's call slots: send what is queued, then whatever queued meanwhile, until
/// the queue is empty. The first call's requests are taken when this task first runs, not
/// when it was spawned: the requests that arrived meanwhile (a burst a serving thread read
/// from one socket read, say) go in it too, at no wait of their own.
async fn drive(shared: Arc<Shared>, lane: Arc<Lane>) {
    let mut again: Vec<Request> = Vec::new();
    loop {
        let batch = {
            let mut queue = lock(&lane.queue);
            for request in again.into_iter().rev() {
                queue.push_front(request);
            }
            if queue.is_empty() {
                queue.in_flight -= 1;
                return;
            }
            take(&mut queue, shared.lanes.batch)
        };
        again = send(&shared, batch).await;
    }
}

/// Send one call and answer its requests; returns those to send again.
async fn send(shared: &Shared, batch: Vec<Request>) -> Vec<Request> {
    let now = Instant::now();
    let mut live = Vec::with_capacity(batch.len());
    // Answers go out together when their post is dropped: these before the call.
    let mut late = Post::default();
    for request in batch {
        if request.answer.is_closed() {
            continue;
        }
        if request.deadline.is_some_and(|d| d <= now) {
            late.send(
                request.mailbox.as_ref(),
                request.answer,
                Err(BackendError::Late),
            );
            continue;
        }
        live.push(request);
    }
    drop(late);
    let mut post = Post::default();
    let Some(first) = live.first() else {
        return Vec::new();
    };
    let bound = live.iter().map(|r| r.bound).max().unwrap_or_default();
    let sent = Instant::now();
    // A decision that starts once nobody waits for it any more charges nothing: not past its
    // caller's deadline, nor past this call's bound, when the policy has answered instead.
    let deadline = |r: &Request| {
        let given_up = r.deadline.map_or(sent + bound, |d| d.min(sent + bound));
        shared.clock.redis_time(given_up)
    };
    let call = Call::new(
        live.iter()
            .map(|r| (&r.part, deadline(r).unwrap_or(0)))
            .collect(),
        first.at,
    );
    for request in &live {
        *lock(&request.written) = Some(sent);
    }
    let answer = shared
        .bounded(bound, shared.runner.run(&shared.pool, &call, shared.wait))
        .await
        .and_then(|raw| script::decode(&raw, &call));
    drop(call);
    let answer = match answer {
        Ok(answer) => answer,
        // A call that timed out is one piece of evidence against Redis, however many requests
        // it carried: the first says so, the others are late (as if they had queued
        // instead), lest one slow call count as many failures for the breaker.
        Err(BackendError::Timeout) => {
            for (n, request) in live.into_iter().enumerate() {
                let err = if n == 0 {
                    BackendError::Timeout
                } else {
                    BackendError::Late
                };
                post.send(request.mailbox.as_ref(), request.answer, Err(err));
            }
            return Vec::new();
        }
        Err(err) => {
            for request in live {
                post.send(request.mailbox.as_ref(), request.answer, Err(err.clone()));
            }
            return Vec::new();
        }
    };
    let mut again = Vec::new();
    for (mut request, replies) in live.into_iter().zip(answer.replies) {
        match replies {
            Some(replies) => {
                post.send(request.mailbox.as_ref(), request.answer, Ok(replies));
            }
            // Judged late by the script while its caller still waits: Redis' clock is ahead
            // of the estimate, which restarts from this reply; the request goes once more.
            None if !request.retried && request.deadline.is_some_and(|d| Instant::now() < d) => {
                request.retried = true;
                again.push(request);
            }
            None => {
                post.send(
                    request.mailbox.as_ref(),
                    request.answer,
                    Err(BackendError::Late),
                );
            }
        }
    }
    if again.is_empty() {
        shared.clock.observe(sent, answer.redis_now);
    } else {
        shared.clock.restart(sent, answer.redis_now);
    }
    again
}

#[cfg(test)]
mod tests {
    use super::super::KeyLayout;
    use super::super::script::{Mode, Nonce};
    use super::*;
    use crate::decision::limit::{Limit, Unit};
    use crate::decision::{Hit, Role};

    /// A queued request of `hits` hits on keys of `key_bytes` bytes, named by its bound.
    fn request(name: u64, hits: usize, key_bytes: usize) -> Request {
        let hit = Hit {
            key: String::new(),
            limit: Limit::fixed(10, Unit::Minute),
            units: 1,
            role: Role::Enforce,
            permit: None,
        };
        let mut part = Part::new(Mode::Atomic, Nonce::new());
        for n in 0..hits {
            part.push(
                format!("{n:0>key_bytes$}"),
                &hit,
                1,
                None,
                KeyLayout::Turnstile,
            );
        }
        Request {
            part,
            at: None,
            deadline: None,
            bound: Duration::from_millis(name),
            written: Arc::default(),
            answer: oneshot::channel().0,
            mailbox: None,
            retried: false,
        }
    }

    /// Light requests (1 hit of 10 bytes) go ahead of heavy ones queued before them; a call
    /// carries at most 64 KiB of keys (heavy: 16 hits of 4 000 bytes, one per call with
    /// anything light); every other call starts with the heavy ones, so one too large to
    /// share a call (300 hits) goes alone although light ones keep coming.
    #[test]
    fn light_requests_go_first_but_heavy_ones_are_not_starved() {
        let light = |name| request(name, 1, 10);
        let heavy = |name| request(name, 16, 4_000);
        // (requests queued, then the names the next call takes)
        let steps: Vec<(Vec<Request>, Vec<u64>)> = vec![
            (vec![heavy(1), heavy(2), light(3), light(4)], vec![3, 4, 1]),
            (vec![light(5)], vec![2, 5]),
            (vec![request(6, 300, 10), light(7)], vec![7]),
            (vec![light(8)], vec![6]),
            (vec![], vec![8]),
            (vec![], vec![]),
        ];
        let mut queue = Queue::default();
        for (n, (arrive, expected)) in steps.into_iter().enumerate() {
            for request in arrive {
                queue.push_back(request);
            }
            let taken: Vec<u64> = if queue.is_empty() {
                Vec::new()
            } else {
                take(&mut queue, 64)
                    .iter()
                    .map(|r| r.bound.as_millis() as u64)
                    .collect()
            };
            assert_eq!(taken, expected, "call {n}");
        }
        assert_eq!(queue.hits, 0, "every hit taken is counted out");
    }
}
