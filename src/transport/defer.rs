//! A connection's writes deferred while the streams a version woke write
//! their responses, so that one `writev` carries them.
//!
//! A stream's task writes a response into h2 and wakes its connection's
//! task, which tokio runs next (the woken task goes to the worker's LIFO
//! slot): one `writev` per response, even when the connection's other
//! streams have responses of the same version coming. The wake index arms
//! a connection's [`ConnectionGate`] before it wakes the connection's
//! streams; armed, the connection's next poll is deferred to when tokio
//! wakes deferred tasks (`yield_now`'s rule: once the worker has run what
//! was runnable, or every `event_interval` tasks, 61 by default), and its
//! write carries every response queued by then. A connection not armed
//! (a client's first request, an ACK, anything but a version) is polled at
//! once, as before: only a version's wakes are gathered, so the sync of
//! many clients keeps each response alive only until it is written (the
//! heap it leaves behind at rest is the same).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use atomic_waker::AtomicWaker;

/// A connection's switch for deferring its next poll, shared by its task
/// and the registry entries of its streams.
#[derive(Clone, Default)]
pub struct ConnectionGate(Arc<Flag>);

impl std::fmt::Debug for ConnectionGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ConnectionGate").field(&self.key()).finish()
    }
}

impl ConnectionGate {
    /// The connection's next poll is deferred: its streams are about to be
    /// woken by a version.
    pub fn arm(&self) {
        self.0.armed.store(true, Ordering::Release);
    }

    /// Whether it was armed since this was last asked (for tests).
    #[cfg(test)]
    pub fn take_armed(&self) -> bool {
        self.0.armed.swap(false, Ordering::AcqRel)
    }

    /// A key of the connection, the same for all its streams while it lives
    /// (its gate's address: a connection opened after this one closed may
    /// get it again, which only orders wakes).
    pub fn key(&self) -> u64 {
        Arc::as_ptr(&self.0) as usize as u64
    }
}

pin_project_lite::pin_project! {
    /// A connection's task future with its polls deferred while its gate
    /// is armed. A struct rather than an async fn: an async fn's state kept
    /// the future twice (its argument and the pinned local), and a
    /// connection's task is as large as its future for the connection's
    /// whole life.
    pub struct Deferred<F> {
        #[pin]
        future: F,
        gate: ConnectionGate,
        // A deferral is pending: polls before it fires are spurious.
        waiting: bool,
    }
}

impl<F> Deferred<F> {
    pub fn new(gate: ConnectionGate, future: F) -> Self {
        Deferred {
            future,
            gate,
            waiting: false,
        }
    }
}

/// Set when the deferral fires (and whether one is asked for); the task's
/// waker, to wake it then.
#[derive(Default)]
struct Flag {
    armed: AtomicBool,
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

impl<F: Future> Future for Deferred<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let flag = &this.gate.0;
        if !*this.waiting {
            // Read before it is cleared: most polls find it unarmed, and a
            // load writes nothing to the shared line.
            if !(flag.armed.load(Ordering::Acquire) && flag.armed.swap(false, Ordering::AcqRel)) {
                return this.future.poll(cx);
            }
            flag.task.register(cx.waker());
            *this.waiting = true;
            let waker = Waker::from(flag.clone());
            // Registers the deferral; its own completion is not needed.
            let yielded = std::pin::pin!(tokio::task::yield_now());
            let _ = yielded.poll(&mut Context::from_waker(&waker));
            return Poll::Pending;
        }
        flag.task.register(cx.waker());
        if !flag.fired.swap(false, Ordering::AcqRel) {
            // Woken again before the deferral fired (another stream wrote):
            // the deferral still comes.
            return Poll::Pending;
        }
        *this.waiting = false;
        this.future.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;

    /// A connection's task as a channel's reader that logs what each of
    /// its future's polls took; `others` tasks each send one value and log.
    /// Returns the log once the reader has taken `1 + others` values, and
    /// its future's polls.
    async fn woken_while_others_run(armed: bool, others: u32) -> (Vec<String>, usize) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let polls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
        let gate = ConnectionGate::default();
        let want = 1 + others as usize;
        let reader = tokio::spawn({
            let (log, polls) = (log.clone(), polls.clone());
            let mut got = Vec::new();
            Deferred::new(
                gate.clone(),
                std::future::poll_fn(move |cx| {
                    polls.fetch_add(1, Ordering::SeqCst);
                    let before = got.len();
                    while let Poll::Ready(Some(n)) = rx.poll_recv(cx) {
                        got.push(n);
                    }
                    if got.len() > before {
                        log.lock().unwrap().push(format!("reader took {:?}", &got[before..]));
                    }
                    if got.len() == want {
                        Poll::Ready(())
                    } else {
                        Poll::Pending
                    }
                }),
            )
        });
        // It waits, polled once.
        while polls.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        if armed {
            gate.arm();
        }
        // Woken, then made runnable again by each of the other tasks.
        tx.send(1).unwrap();
        let others: Vec<_> = (2..2 + others)
            .map(|n| {
                let (log, tx) = (log.clone(), tx.clone());
                tokio::spawn(async move {
                    tx.send(n).unwrap();
                    log.lock().unwrap().push(format!("task {n}"));
                })
            })
            .collect();
        tokio::time::timeout(Duration::from_secs(5), reader)
            .await
            .expect("the reader completes")
            .unwrap();
        for other in others {
            other.await.unwrap();
        }
        let log = log.lock().unwrap().clone();
        (log, polls.load(Ordering::SeqCst))
    }

    /// Armed, a connection's task woken while other tasks are runnable runs
    /// after them, its future polled once however often it was woken in
    /// between: one poll takes what they all queued.
    #[tokio::test]
    async fn an_armed_connection_runs_after_the_tasks_runnable_when_it_is_woken() {
        let (log, polls) = woken_while_others_run(true, 2).await;
        assert_eq!(
            log,
            ["task 2", "task 3", "reader took [1, 2, 3]"],
            "it ran after the tasks runnable when it was woken"
        );
        assert_eq!(polls, 2, "its future was polled once more, not once a wake");
    }

    /// Not armed (anything but a version's wakes), it is polled at once:
    /// each value is taken as it comes.
    #[tokio::test]
    async fn a_connection_not_armed_is_polled_at_once() {
        let (log, _) = woken_while_others_run(false, 2).await;
        assert_eq!(log, ["reader took [1]", "task 2", "task 3", "reader took [2, 3]"]);
    }
}
