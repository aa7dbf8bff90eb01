//! One timer kept due on each serving thread while it serves calls.
//!
//! Why: a call that waits (for its body, for Redis) arms deadline timers, and tokio's timer
//! wakes the thread's own event loop (a write to its eventfd, then a spurious return from
//! `epoll_wait`) whenever a timer is armed earlier than every timer the loop last parked
//! with, and always when it parked with none. Under load a serving thread often parks with
//! no call waiting, so until its next park every call armed paid a wake-up of its own. With
//! a timer always due within `PERIOD`, the loop parks with one earlier than any call's
//! deadline, and arming those wakes nothing. The timer lapses after a period in which no call began:
//! an idle process is not woken.

use std::cell::Cell;
use std::time::Duration;

/// Shorter than any deadline a call usually has; 100 wake-ups a second on a busy thread.
const PERIOD: Duration = Duration::from_millis(10);

#[derive(Clone, Copy, Default)]
struct Keeper {
    /// Calls begun on this thread since the timer last fired.
    begun: u64,
    running: bool,
}

thread_local! {
    static KEEPER: Cell<Keeper> = Cell::new(Keeper::default());
}

/// A call begins on this thread (which runs a tokio runtime): keep a timer due here.
pub fn call_begins() {
    let keeper = KEEPER.get();
    KEEPER.set(Keeper {
        begun: keeper.begun + 1,
        running: true,
    });
    if !keeper.running {
        tokio::spawn(keep_due());
    }
}

/// The timer's task. However it ends (it lapses, or its runtime is dropped with it, polled
/// or not), the next call on this thread starts another.
fn keep_due() -> impl std::future::Future<Output = ()> {
    struct Stopped;
    impl Drop for Stopped {
        fn drop(&mut self) {
            // A runtime dropped as its thread exits may find the state gone already.
            let _ = KEEPER.try_with(|keeper| keeper.set(Keeper::default()));
        }
    }
    let stopped = Stopped;
    async move {
        let _stopped = stopped;
        while KEEPER.get().begun > 0 {
            KEEPER.set(Keeper {
                begun: 0,
                running: true,
            });
            tokio::time::sleep(PERIOD).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "current_thread")]
    async fn the_timer_runs_from_a_call_and_lapses_once_calls_stop() {
        assert!(!KEEPER.get().running, "no call, no timer");
        call_begins();
        assert!(KEEPER.get().running);
        // A tick that saw the call keeps it; the next, seeing none, ends it.
        let waited = std::time::Instant::now();
        while KEEPER.get().running {
            assert!(
                waited.elapsed() < Duration::from_secs(5),
                "the timer outlived the calls"
            );
            tokio::time::sleep(PERIOD).await;
        }
        assert!(
            waited.elapsed() >= PERIOD,
            "it lapsed before a period passed"
        );
        call_begins();
        assert!(KEEPER.get().running, "a later call starts it again");
    }

    #[test]
    fn a_runtime_dropped_with_its_timer_leaves_the_next_call_to_start_one() {
        std::thread::spawn(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap();
            runtime.block_on(async { call_begins() });
            assert!(KEEPER.get().running);
            drop(runtime);
            assert!(!KEEPER.get().running, "the timer went with its runtime");
        })
        .join()
        .unwrap();
    }
}
