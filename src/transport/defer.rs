//! A connection's task run after the tasks that are runnable when it is
//! woken, so that its writes carry what they queued.
//!
//! A stream's task writes a response into h2 and wakes its connection's
//! task, which tokio runs next (the woken task goes to the worker's LIFO
//! slot): one `writev` per response, even when the connection's other
//! streams have responses of the same version coming. Deferred, the
//! connection's task is polled once the worker has run what was runnable
//! (at most `event_interval` tasks, 61 by default, before tokio wakes what
//! was deferred), and its write carries every response queued by then.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use atomic_waker::AtomicWaker;

pin_project_lite::pin_project! {
    /// `future`, each of its polls after a wake deferred to when tokio
    /// wakes deferred tasks (`yield_now`'s rule). A struct rather than an
    /// async fn: an async fn's state kept the future twice (its argument
    /// and the pinned local), and a connection's task is as large as its
    /// future for the connection's whole life.
    pub struct Deferred<F> {
        #[pin]
        future: F,
        defer: Defer,
    }
}

/// Runs `future` deferred (see [`Deferred`]).
pub fn deferred<F: Future>(future: F) -> Deferred<F> {
    Deferred {
        future,
        defer: Defer::default(),
    }
}

impl<F: Future> Future for Deferred<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        this.defer.poll(cx, this.future)
    }
}

#[derive(Default)]
struct Defer {
    flag: Arc<Flag>,
    /// A deferral is pending: polls before it fires are spurious.
    waiting: bool,
}

/// Set when the deferral fires; the task's waker, to wake it then.
#[derive(Default)]
struct Flag {
    fired: AtomicBool,
    task: AtomicWaker,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.fired.store(true, Ordering::Release);
        self.task.wake();
    }
}

impl Defer {
    fn poll<F: Future>(&mut self, cx: &mut Context<'_>, future: Pin<&mut F>) -> Poll<F::Output> {
        self.flag.task.register(cx.waker());
        if !self.waiting {
            self.waiting = true;
            let waker = Waker::from(self.flag.clone());
            // Registers the deferral; its own completion is not needed.
            let yielded = std::pin::pin!(tokio::task::yield_now());
            let _ = yielded.poll(&mut Context::from_waker(&waker));
            return Poll::Pending;
        }
        if !self.flag.fired.swap(false, Ordering::AcqRel) {
            // Woken again before the deferral fired (another stream wrote):
            // the deferral still comes.
            return Poll::Pending;
        }
        self.waiting = false;
        future.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;

    /// Woken while other tasks are runnable, a deferred task runs after
    /// them, once, however often it was woken in between; it completes with
    /// its future's output.
    #[tokio::test]
    async fn a_deferred_task_runs_after_the_tasks_runnable_when_it_is_woken() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let polls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
        let deferred_task = tokio::spawn({
            let (log, polls) = (log.clone(), polls.clone());
            deferred(std::future::poll_fn(move |cx| {
                polls.fetch_add(1, Ordering::SeqCst);
                let mut got = Vec::new();
                while let Poll::Ready(Some(n)) = rx.poll_recv(cx) {
                    got.push(n);
                }
                if got.is_empty() {
                    return Poll::Pending;
                }
                log.lock().unwrap().push(format!("deferred got {got:?}"));
                Poll::Ready(got.len())
            }))
        });
        // It waits, having been polled once (after its first deferral).
        while polls.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        // Woken, then made runnable again by each of two other tasks.
        tx.send(1).unwrap();
        let others: Vec<_> = (2..4)
            .map(|n| {
                let (log, tx) = (log.clone(), tx.clone());
                tokio::spawn(async move {
                    tx.send(n).unwrap();
                    log.lock().unwrap().push(format!("task {n}"));
                })
            })
            .collect();
        let got = tokio::time::timeout(Duration::from_secs(5), deferred_task)
            .await
            .expect("the deferred task completes")
            .unwrap();
        for other in others {
            other.await.unwrap();
        }
        assert_eq!(got, 3, "one poll took all three");
        assert_eq!(
            *log.lock().unwrap(),
            ["task 2", "task 3", "deferred got [1, 2, 3]"],
            "it ran after the tasks runnable when it was woken"
        );
        assert_eq!(
            polls.load(Ordering::SeqCst),
            2,
            "its future was polled once more, not once a wake"
        );
    }
}
