//! Where a backend's Redis I/O runs: on the thread serving the call that needs it.
//!
//! Each serving thread (a current-thread runtime) has its own connections, lanes and timers
//! for each backend ([`Shared`]), opened in the background at its first call, so a call is
//! written, read and timed on the thread that serves it and its answer wakes no other thread
//! (measured in BENCHMARKS.md). The process's I/O thread (`io`) serves everyone else, and a
//! serving thread's calls while its own connections are not open: a call never waits for a
//! connection to be made. A thread too busy to read a reply in time is late itself, which
//! its lag tells (`Shared::within`), so a reply Redis gave in time is not blamed on Redis.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::time::{Duration, Instant};

use tokio::runtime::{Handle, Id, Runtime, RuntimeFlavor};

use super::{Learned, RedisConfig, Shared};
use crate::decision::BackendError;

/// How long a serving thread whose own connections failed to open uses the I/O thread's
/// before it tries again.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The runtime that drives the connections of callers off a serving thread: one thread,
/// shared by every backend of the process, never dropped.
pub(super) fn io() -> &'static Handle {
    static IO: LazyLock<Runtime> = LazyLock::new(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("turnstile-redis")
            .enable_all()
            .build()
            .expect("cannot start the Redis I/O runtime")
    });
    IO.handle()
}

/// The runtime of the thread this runs on, if that thread is its runtime's only one (a
/// current-thread runtime: a thread serving gRPC).
pub(super) fn serving_thread() -> Option<Handle> {
    Handle::try_current()
        .ok()
        .filter(|handle| handle.runtime_flavor() == RuntimeFlavor::CurrentThread)
}

/// A backend's connections: the I/O thread's, made when it connects, and each serving
/// thread's, made at its first call.
pub(super) struct ThreadConnections {
    config: RedisConfig,
    learned: Learned,
    io: Arc<Shared>,
}

thread_local! {
    /// This thread's own connections, per backend and runtime.
    static OWN: RefCell<Vec<Own>> = const { RefCell::new(Vec::new()) };
}

struct Own {
    connections: Weak<ThreadConnections>,
    runtime: Id,
    /// False once that runtime has shut down (a thread may run several in turn, as tests do).
    running: Arc<AtomicBool>,
    state: State,
}

enum State {
    Opening,
    Open(Arc<Shared>),
    /// Failed to open at this time.
    Failed(Instant),
}

impl ThreadConnections {
    /// Connect on the I/O thread, within `config.connect_timeout`.
    pub(super) async fn connect(
        config: &RedisConfig,
    ) -> Result<Arc<ThreadConnections>, BackendError> {
        let learned = Learned::default();
        let (owned, shared) = (config.clone(), learned.clone());
        let open = async move { Shared::open(&owned, shared).await.map(Arc::new) };
        let io = run_on(io().clone(), open).await?;
        Ok(Arc::new(ThreadConnections {
            config: config.clone(),
            learned,
            io,
        }))
    }

    /// What every runtime's calls learned of the servers.
    pub(super) fn learned(&self) -> &Learned {
        &self.learned
    }

    /// The I/O thread's connections.
    pub(super) fn io(&self) -> &Arc<Shared> {
        &self.io
    }

    /// The connections a call made here goes on: this serving thread's own once open, the
    /// I/O thread's until then (and off a serving thread).
    pub(super) fn here(self: &Arc<Self>) -> Arc<Shared> {
        let Some(handle) = serving_thread() else {
            return Arc::clone(&self.io);
        };
        let runtime = handle.id();
        let open = OWN.with(|own| {
            let mut own = own.borrow_mut();
            let mine = own.iter_mut().find(|o| {
                o.runtime == runtime && std::ptr::eq(o.connections.as_ptr(), Arc::as_ptr(self))
            });
            match mine {
                Some(Own {
                    state: State::Open(shared),
                    ..
                }) => return Some(Arc::clone(shared)),
                Some(Own {
                    state: State::Opening,
                    ..
                }) => return None,
                Some(Own {
                    state: State::Failed(at),
                    ..
                }) if at.elapsed() < RETRY_AFTER => return None,
                Some(mine) => mine.state = State::Opening,
                None => {
                    // What a dropped backend, or an ended runtime, left behind: pruned when
                    // an entry is added, not on every call.
                    own.retain(|o| {
                        o.running.load(Ordering::Acquire) && o.connections.strong_count() > 0
                    });
                    own.push(Own {
                        connections: Arc::downgrade(self),
                        runtime,
                        running: running(&handle),
                        state: State::Opening,
                    });
                }
            }
            handle.spawn(self.open_here());
            None
        });
        open.unwrap_or_else(|| Arc::clone(&self.io))
    }

    /// Open this thread's own connections (run on it, so that it drives them), and say so
    /// to the calls that come after.
    fn open_here(self: &Arc<Self>) -> impl Future<Output = ()> + Send + 'static {
        let connections = Arc::downgrade(self);
        let (config, learned) = (self.config.clone(), self.learned.clone());
        async move {
            let state = match Shared::open(&config, learned).await {
                Ok(shared) => State::Open(Arc::new(shared)),
                Err(error) => {
                    tracing::debug!(%error, "a serving thread could not open its own Redis connections; it uses the I/O thread's");
                    State::Failed(Instant::now())
                }
            };
            let runtime = Handle::current().id();
            OWN.with(|own| {
                let mut own = own.borrow_mut();
                let mine = own
                    .iter_mut()
                    .find(|o| o.runtime == runtime && Weak::ptr_eq(&o.connections, &connections));
                if let Some(mine) = mine {
                    mine.state = state;
                }
            });
        }
    }
}

thread_local! {
    /// A flag per runtime run on this thread, true while it runs (`running`).
    static RUNNING: RefCell<Vec<(Id, Arc<AtomicBool>)>> = const { RefCell::new(Vec::new()) };
}

/// A flag that stays true while `runtime` runs: a task of it, which never ends, clears it
/// when dropped. One per runtime, shared by its backends and its mailbox.
pub(super) fn running(runtime: &Handle) -> Arc<AtomicBool> {
    struct Clears(Arc<AtomicBool>);
    impl Drop for Clears {
        fn drop(&mut self) {
            self.0.store(false, Ordering::Release);
        }
    }
    RUNNING.with(|flags| {
        let mut flags = flags.borrow_mut();
        flags.retain(|(_, flag)| flag.load(Ordering::Acquire));
        if let Some((_, flag)) = flags.iter().find(|(id, _)| *id == runtime.id()) {
            return Arc::clone(flag);
        }
        let flag = Arc::new(AtomicBool::new(true));
        // Made before the task, so that it clears the flag even if never polled.
        let clears = Clears(Arc::clone(&flag));
        runtime.spawn(async move {
            let _clears = clears;
            std::future::pending::<()>().await;
        });
        flags.push((runtime.id(), Arc::clone(&flag)));
        flag
    })
}

/// Run `work` on `runtime` (so that what it opens is driven, and what it waits for timed,
/// there), started now; the future is its output.
pub(super) fn run_on<T: Send + 'static>(
    runtime: Handle,
    work: impl Future<Output = Result<T, BackendError>> + Send + 'static,
) -> impl Future<Output = Result<T, BackendError>> {
    let task = runtime.spawn(work);
    async move {
        task.await.unwrap_or_else(|err| {
            Err(BackendError::Unavailable(format!(
                "a Redis call failed: {err}"
            )))
        })
    }
}
