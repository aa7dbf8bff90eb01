//! Answers go back to the thread that asked for them all at once, one wake-up per thread per
//! call.
//!
//! While a serving thread's own connections are being opened (`threads`), its calls go on
//! the I/O thread's. Answered one by one, each answer would wake the serving thread and be
//! written alone; so the I/O thread drops a call's answers for a thread in its mailbox and
//! wakes it once, and their responses leave together. Only a current-thread runtime (a gRPC
//! serving thread) has a mailbox; elsewhere a request is answered directly.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::runtime::Id;
use tokio::sync::{Notify, oneshot};

use super::script::Reply;
use super::threads::{running, serving_thread};
use crate::decision::BackendError;

/// What a request waits for.
pub(super) type RequestAnswer = Result<Vec<Reply>, BackendError>;

/// Where one thread's answers wait for it.
pub(super) struct Mailbox {
    letters: Mutex<Vec<Letter>>,
    ring: Notify,
    /// False once its runtime, which runs the task that empties it, has shut down.
    open: Arc<AtomicBool>,
    /// The runtime that task runs on.
    runtime: Id,
}

/// An answer and the request it is for.
type Letter = (oneshot::Sender<RequestAnswer>, RequestAnswer);

thread_local! {
    /// This thread's mailbox.
    static MAILBOX: RefCell<Option<Arc<Mailbox>>> = const { RefCell::new(None) };
}

impl Mailbox {
    /// The mailbox of the thread this runs on, made (with the task that empties it) on first
    /// use, and anew for another runtime run on the thread; None off a current-thread runtime.
    pub(super) fn here() -> Option<Arc<Mailbox>> {
        let handle = serving_thread()?;
        MAILBOX.with(|here| {
            let mut here = here.borrow_mut();
            if let Some(mailbox) = here.as_ref()
                && mailbox.runtime == handle.id()
                && mailbox.open.load(Ordering::Acquire)
            {
                return Some(Arc::clone(mailbox));
            }
            let mailbox = Arc::new(Mailbox {
                letters: Mutex::default(),
                ring: Notify::new(),
                open: running(&handle),
                runtime: handle.id(),
            });
            handle.spawn(Arc::clone(&mailbox).empty());
            *here = Some(Arc::clone(&mailbox));
            Some(mailbox)
        })
    }

    /// Hands letters to their requests each time the mailbox rings, until its runtime ends.
    async fn empty(self: Arc<Self>) {
        let mut letters = Vec::new();
        loop {
            self.ring.notified().await;
            std::mem::swap(&mut letters, &mut *self.lock());
            for (request, answer) in letters.drain(..) {
                let _ = request.send(answer);
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Letter>> {
        self.letters.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Answers gathered for delivery: each to its request's mailbox, or directly.
#[derive(Default)]
pub(super) struct Post {
    bags: Vec<(Arc<Mailbox>, Vec<Letter>)>,
}

impl Post {
    /// Answer `request` now if it has no open mailbox, else when the post is dropped.
    pub(super) fn send(
        &mut self,
        mailbox: Option<&Arc<Mailbox>>,
        request: oneshot::Sender<RequestAnswer>,
        answer: RequestAnswer,
    ) {
        let Some(mailbox) = mailbox.filter(|m| m.open.load(Ordering::Acquire)) else {
            let _ = request.send(answer);
            return;
        };
        // A handful of serving threads: a scan beats a map.
        match self
            .bags
            .iter_mut()
            .find(|(to, _)| Arc::ptr_eq(to, mailbox))
        {
            Some((_, bag)) => bag.push((request, answer)),
            None => self
                .bags
                .push((Arc::clone(mailbox), vec![(request, answer)])),
        }
    }
}

/// Dropping the post delivers it: every gathered answer goes in its mailbox, and each
/// mailbox rings once. (On every way out of a call, so no answer is held back.)
impl Drop for Post {
    fn drop(&mut self) {
        for (mailbox, bag) in self.bags.drain(..) {
            mailbox.lock().extend(bag);
            mailbox.ring.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::oneshot::error::TryRecvError;

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// An answer that says which it is.
    fn answer(n: usize) -> RequestAnswer {
        Err(BackendError::Unavailable(n.to_string()))
    }

    fn which(answer: RequestAnswer) -> usize {
        match answer {
            Err(BackendError::Unavailable(n)) => n.parse().unwrap(),
            _ => panic!("not one of the test's answers"),
        }
    }

    #[test]
    fn a_calls_answers_wait_in_the_mailbox_until_the_post_is_delivered_then_all_arrive() {
        current_thread().block_on(async {
            let mailbox = Mailbox::here().expect("a current-thread runtime has a mailbox");
            let (senders, mut receivers): (Vec<_>, Vec<_>) =
                (0..5).map(|_| oneshot::channel()).unzip();
            let (posted, deliver) = std::sync::mpsc::channel::<()>();
            let (gathered, wait_gathered) = oneshot::channel::<()>();
            // The I/O thread's side: gather every answer, deliver when told.
            let io = std::thread::spawn(move || {
                let mut post = Post::default();
                for (n, sender) in senders.into_iter().enumerate() {
                    post.send(Some(&mailbox), sender, answer(n));
                }
                gathered.send(()).unwrap();
                deliver.recv().unwrap();
                drop(post);
            });
            wait_gathered.await.unwrap();
            tokio::task::yield_now().await;
            for receiver in &mut receivers {
                assert!(matches!(receiver.try_recv(), Err(TryRecvError::Empty)));
            }
            posted.send(()).unwrap();
            for (n, receiver) in receivers.into_iter().enumerate() {
                assert_eq!(which(receiver.await.unwrap()), n);
            }
            io.join().unwrap();
        });
    }

    #[test]
    fn without_a_mailbox_an_answer_goes_at_once() {
        let (sender, mut receiver) = oneshot::channel();
        let mut post = Post::default();
        post.send(None, sender, answer(2));
        assert_eq!(which(receiver.try_recv().unwrap()), 2);
    }

    #[test]
    fn only_a_current_thread_runtime_has_a_mailbox() {
        assert!(Mailbox::here().is_none(), "no runtime");
        let multi = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        assert!(multi.block_on(async { Mailbox::here() }).is_none());
    }

    #[test]
    fn a_mailbox_ends_with_its_runtime_and_its_thread_gets_a_new_one() {
        let first = current_thread();
        let old = first.block_on(async { Mailbox::here().unwrap() });
        assert!(
            first
                .block_on(async { Mailbox::here().unwrap() })
                .open
                .load(Ordering::Acquire)
        );
        drop(first);
        assert!(
            !old.open.load(Ordering::Acquire),
            "its task went with its runtime"
        );
        // An answer for a request of that runtime goes directly, not into a box nobody empties.
        let (sender, mut receiver) = oneshot::channel();
        let mut post = Post::default();
        post.send(Some(&old), sender, answer(1));
        assert_eq!(which(receiver.try_recv().unwrap()), 1);
        let new = current_thread().block_on(async { Mailbox::here().unwrap() });
        assert!(!Arc::ptr_eq(&old, &new));
    }
}
