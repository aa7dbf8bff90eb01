//! Requests whose hits live in several Cluster slots. One script call cannot span slots, so
//! each slot's hits are charged by a call of their own ('each' mode: a reservation), all
//! concurrently; when the request turns out refused and charging is atomic, the reservations
//! are refunded. Between the two steps a concurrent request may see reserved units as spent:
//! this can briefly under-admit, never over-admit.
//!
//! The work runs in a task of its own, so a caller that times out or goes away cannot leave a
//! reservation unrefunded.

use std::sync::Arc;

use ::redis::cluster_routing::Slot;
use tokio::task::JoinSet;

use super::script::{Mode, Nonce, Part, Reply};
use super::{Shared, coalesce};
use crate::algorithm::Micros;
use crate::decision::deadline::Deadline;
use crate::decision::{BackendError, Charging, Hit, Outcome, request_refused};

/// Indices of the hits, grouped by the slot of their key, in order of first appearance.
pub(super) fn group_by_slot(keys: &[String]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(Slot, Vec<usize>)> = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let slot = Slot::for_key(key);
        match groups.iter_mut().find(|(s, _)| *s == slot) {
            Some((_, members)) => members.push(i),
            None => groups.push((slot, vec![i])),
        }
    }
    groups.into_iter().map(|(_, members)| members).collect()
}

/// One request across slots.
pub(super) struct Job {
    shared: Arc<Shared>,
    /// Each hit with its Redis key, in request order.
    hits: Vec<(String, Hit)>,
    groups: Vec<Vec<usize>>,
    charging: Charging,
    nonce: Nonce,
    /// When the caller stops waiting: a reservation that would start later takes nothing.
    deadline: Option<Deadline>,
    /// The time to decide at, when not Redis TIME (tests only).
    at: Option<Micros>,
}

impl Job {
    pub(super) fn new(
        shared: Arc<Shared>,
        hits: &[Hit],
        keys: Vec<String>,
        groups: Vec<Vec<usize>>,
        charging: Charging,
        nonce: Nonce,
        at: Option<Micros>,
    ) -> Job {
        Job {
            shared,
            hits: keys.into_iter().zip(hits.iter().cloned()).collect(),
            groups,
            charging,
            nonce,
            at,
            deadline: None,
        }
    }

    pub(super) fn until(self, deadline: Deadline) -> Job {
        Job {
            deadline: Some(deadline),
            ..self
        }
    }

    /// Run the job in its own task (a caller that gives up does not cut its refund short).
    /// The caller waits as a single call's does: to its deadline while the job's calls queue
    /// (each written call is bounded on its own, `coalesce::call`), at least the call
    /// timeout, and once more if this process's own lag explains the wait. Bounded by the
    /// call timeout alone, a request queued behind a pause of turnstile itself failed.
    pub(super) async fn evaluate(self) -> Result<Vec<Outcome>, BackendError> {
        let shared = Arc::clone(&self.shared);
        let wait = self.deadline.map_or(shared.call_timeout, |deadline| {
            deadline.remaining().max(shared.call_timeout)
        });
        let task = tokio::spawn(self.run());
        match shared.within(wait, task).await {
            Ok(Ok(result)) => result,
            Ok(Err(err)) => Err(BackendError::Unavailable(format!(
                "a Redis Cluster request failed: {err}"
            ))),
            // Its calls report Redis' own timeouts; past the caller's wait the time went here.
            Err(_) => Err(BackendError::Late),
        }
    }

    async fn run(self) -> Result<Vec<Outcome>, BackendError> {
        let calls = self.groups.iter().map(|group| {
            let mode = match self.charging {
                Charging::Nothing => Mode::Check,
                Charging::Atomic | Charging::PerDescriptor => Mode::PerDescriptor,
            };
            let mut part = Part::new(mode, self.nonce);
            for &i in group {
                let (key, hit) = &self.hits[i];
                part.push(key.clone(), hit, hit.units, None, self.layout());
            }
            part
        });
        let replies = self.all(calls.collect(), self.deadline).await;

        let mut verdicts: Vec<Option<Reply>> = (0..self.hits.len()).map(|_| None).collect();
        for (group, replies) in self.groups.iter().zip(replies) {
            // A failed group fails the request. Reservations that did go through stay
            // charged: an error may be answered by admitting, so refunding could over-admit.
            for (&i, reply) in group.iter().zip(replies?) {
                verdicts[i] = Some(reply);
            }
        }
        let verdicts: Vec<Reply> = verdicts.into_iter().flatten().collect();
        let refused = request_refused(
            self.hits
                .iter()
                .zip(&verdicts)
                .map(|((_, hit), v)| (hit.role, v.outcome.admitted)),
        );
        if refused && self.charging == Charging::Atomic {
            self.refund(&verdicts).await;
        }
        Ok(verdicts.into_iter().map(|v| v.outcome).collect())
    }

    /// Undo every reservation. A refund call carries all the hits of its group, in the order
    /// of the reservation, because the script names sliding-window entries after the hit's
    /// index within the call; hits that were not charged go with cost 0, which the script
    /// skips.
    async fn refund(&self, verdicts: &[Reply]) {
        let charged = |i: usize| verdicts[i].outcome.admitted && self.hits[i].1.units > 0;
        let calls = self
            .groups
            .iter()
            .filter(|group| group.iter().any(|&i| charged(i)))
            .map(|group| {
                let mut part = Part::new(Mode::Refund, self.nonce);
                for &i in group {
                    let (key, hit) = &self.hits[i];
                    let cost = if charged(i) { hit.units } else { 0 };
                    let stamp = Some(verdicts[i].stamp);
                    part.push(key.clone(), hit, cost, stamp, self.layout());
                }
                part
            });
        for result in self.all(calls.collect(), None).await {
            if let Err(err) = result {
                tracing::warn!(%err, "refunding a refused request's reservation in Redis failed");
            }
        }
    }

    fn layout(&self) -> super::KeyLayout {
        self.shared.key_layout
    }

    /// Run the parts concurrently, each in its slot's lane; results in the order of `parts`.
    async fn all(
        &self,
        parts: Vec<Part>,
        deadline: Option<Deadline>,
    ) -> Vec<Result<Vec<Reply>, BackendError>> {
        let mut tasks = JoinSet::new();
        for (n, part) in parts.into_iter().enumerate() {
            let shared = Arc::clone(&self.shared);
            let at = self.at;
            tasks.spawn(async move {
                let slot = shared.slot(&part);
                let bound = shared.cleanup_timeout;
                let result = coalesce::call(&shared, slot, part, at, deadline, bound).await;
                (n, result)
            });
        }
        let mut results: Vec<_> = (0..tasks.len())
            .map(|_| Err(BackendError::Unavailable("a Redis call was lost".into())))
            .collect();
        while let Some(joined) = tasks.join_next().await {
            if let Ok((n, result)) = joined {
                results[n] = result;
            }
        }
        results
    }
}
