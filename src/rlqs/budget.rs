//! Bytes that all RLQS streams together may hold, and one stream's charge against them.
//!
//! A stream is cheap to open and may hold a lot (a report of up to a message's bound, its
//! answer, the buckets it tracks), so a per-stream bound alone lets many streams hold many
//! times what one may. What they hold together is counted here, and what does not fit is
//! refused instead of allocated.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes all streams together may hold of one kind.
#[derive(Debug)]
pub struct Budget {
    used: AtomicUsize,
    max: usize,
}

impl Budget {
    pub fn new(max: usize) -> Arc<Budget> {
        Arc::new(Budget {
            used: AtomicUsize::new(0),
            max,
        })
    }

    /// Count `bytes` more, if they fit.
    pub fn take(&self, bytes: usize) -> bool {
        self.used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                used.checked_add(bytes).filter(|&now| now <= self.max)
            })
            .is_ok()
    }

    /// Count `bytes` fewer: they were taken and are freed.
    pub fn give_back(&self, bytes: usize) {
        self.used.fetch_sub(bytes, Ordering::Relaxed);
    }

    pub fn max(&self) -> usize {
        self.max
    }
}

/// What one stream holds of a budget: the most it has needed at once, since the buffers that
/// held it keep their size; given back when the stream ends (the charge is dropped).
#[derive(Debug)]
pub struct Charge {
    budget: Arc<Budget>,
    bytes: usize,
}

impl Charge {
    pub fn new(budget: Arc<Budget>) -> Charge {
        Charge { budget, bytes: 0 }
    }

    /// Hold at least `bytes`, if the budget has room for what that adds.
    pub fn grow_to(&mut self, bytes: usize) -> bool {
        if bytes <= self.bytes {
            return true;
        }
        if !self.budget.take(bytes - self.bytes) {
            return false;
        }
        self.bytes = bytes;
        true
    }

    pub fn budget(&self) -> &Budget {
        &self.budget
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.give_back(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_hold_their_largest_need_until_dropped() {
        let budget = Budget::new(100);
        let mut a = Charge::new(budget.clone());
        let mut b = Charge::new(budget.clone());
        assert!(a.grow_to(60));
        assert!(a.grow_to(30), "less than held needs nothing more");
        assert!(!b.grow_to(41), "60 + 41 is over 100");
        assert!(b.grow_to(40));
        assert!(!a.grow_to(61), "the budget is spent");
        drop(b);
        assert!(a.grow_to(100), "b's 40 came back");
        assert!(!budget.take(1));
        drop(a);
        assert!(budget.take(100), "everything came back");
        assert!(!budget.take(usize::MAX), "no overflow past the bound");
    }
}
