//! What the allocator holds free, given back to the OS while a thread is quiet.
//!
//! mimalloc returns a thread's emptied pages only when that thread allocates or collects
//! again, so a serving thread gone quiet after a burst (ended RLQS streams, swept keys) would
//! keep them all. Each serving thread collects on a timer; a collection walks only that
//! thread's own heap.

use std::time::Duration;

/// How often a serving thread gives back what it holds free.
const PERIOD: Duration = Duration::from_secs(1);

/// Give back this thread's free pages every `PERIOD`, for as long as its runtime runs.
pub async fn give_back() {
    let mut tick = tokio::time::interval(PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // SAFETY: mimalloc's collection of the calling thread's own heap, which frees only
        // pages with no live allocation in them; it takes and returns no pointer.
        unsafe { libmimalloc_sys::mi_collect(false) };
    }
}
