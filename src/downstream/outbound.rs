//! The queue from a stream's task to its response body: responses in order,
//! at most `capacity` waiting, and each side told when the other is gone.
//! Used where the transport writes the body (a stream the gateway dialed
//! out); on the gateway's own listeners a stream's task writes to its
//! HTTP/2 stream itself (`service::Outbound`).
//!
//! Every stream holds one, idle or not, so it is kept small: a `VecDeque`
//! under a mutex with the two sides' wakers, about 100 bytes, and a few more
//! once a response was queued. tokio's bounded channel allocates a
//! 128-byte-aligned channel and a first block of 32 slots up front (1 KiB
//! per stream, a fifth of an idle stream), and futures' channel cannot tell
//! an idle sender that its receiver went away.
//!
//! One sender and one receiver. A waker is stored and woken under the same
//! mutex as the queue it waits on, so no wake-up is lost between a check
//! and a registration.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

struct Shared<T> {
    state: Mutex<State<T>>,
    capacity: usize,
}

struct State<T> {
    items: VecDeque<T>,
    /// The receiver, waiting for an item (or for the sender to go).
    receiver: Option<Waker>,
    /// The sender, waiting for room or for the receiver to go.
    sender: Option<Waker>,
    receiver_gone: bool,
    sender_gone: bool,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // Nothing here panics while holding the lock; a poisoned queue is
        // still a consistent one.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Makes a queue that holds at most `capacity` items (at least 1).
pub fn queue<T>(capacity: usize) -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            items: VecDeque::new(),
            receiver: None,
            sender: None,
            receiver_gone: false,
            sender_gone: false,
        }),
        capacity: capacity.max(1),
    });
    (Sender { shared: shared.clone() }, Receiver { shared })
}

/// Why [`Sender::try_send`] did not queue an item; the item comes back.
#[derive(Debug, PartialEq, Eq)]
pub enum TrySendError<T> {
    /// `capacity` items are waiting.
    Full(T),
    /// The receiver is gone.
    Closed(T),
}

pub struct Sender<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Sender<T> {
    /// Queues `item` if there is room and the receiver is there.
    pub fn try_send(&self, item: T) -> Result<(), TrySendError<T>> {
        let waker = {
            let mut state = self.shared.lock();
            if state.receiver_gone {
                return Err(TrySendError::Closed(item));
            }
            if state.items.len() >= self.shared.capacity {
                return Err(TrySendError::Full(item));
            }
            state.items.push_back(item);
            state.receiver.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Ok(())
    }

    /// Queues `item`, waiting for room; gives it back if the receiver goes.
    pub async fn send(&self, item: T) -> Result<(), T> {
        let mut item = Some(item);
        poll_fn(|cx| {
            let pending = item.take().expect("polled after completion");
            match self.try_send(pending) {
                Ok(()) => Poll::Ready(Ok(())),
                Err(TrySendError::Closed(back)) => Poll::Ready(Err(back)),
                Err(TrySendError::Full(back)) => {
                    item = Some(back);
                    // Checked again under the lock a take wakes us under:
                    // room may have been made since the try.
                    let mut state = self.shared.lock();
                    if state.receiver_gone || state.items.len() < self.shared.capacity {
                        cx.waker().wake_by_ref();
                    } else {
                        state.sender = Some(cx.waker().clone());
                    }
                    Poll::Pending
                }
            }
        })
        .await
    }

    /// Completes when the receiver is gone.
    #[cfg(test)]
    pub async fn closed(&self) {
        poll_fn(|cx| self.poll_closed(cx)).await;
    }

    /// Ready once the receiver is gone.
    pub fn poll_closed(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut state = self.shared.lock();
        if state.receiver_gone {
            return Poll::Ready(());
        }
        if !state.sender.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            state.sender = Some(cx.waker().clone());
        }
        Poll::Pending
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let waker = {
            let mut state = self.shared.lock();
            state.sender_gone = true;
            state.receiver.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

pub struct Receiver<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Receiver<T> {
    /// The next item; `None` once the sender is gone and nothing is left.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let (item, waker) = {
            let mut state = self.shared.lock();
            let was_full = state.items.len() >= self.shared.capacity;
            match state.items.pop_front() {
                // Only a sender waiting for room is woken by a take, not one
                // waiting for the end: a stream's task is not woken for every
                // response its client reads.
                Some(item) => (item, if was_full { state.sender.take() } else { None }),
                None if state.sender_gone => return Poll::Ready(None),
                None => {
                    if !state.receiver.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        state.receiver = Some(cx.waker().clone());
                    }
                    return Poll::Pending;
                }
            }
        };
        if let Some(waker) = waker {
            waker.wake();
        }
        Poll::Ready(Some(item))
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let (items, waker) = {
            let mut state = self.shared.lock();
            state.receiver_gone = true;
            (std::mem::take(&mut state.items), state.sender.take())
        };
        // What was queued goes now, outside the lock.
        drop(items);
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::time::Duration;

    use super::*;

    const LIMIT: Duration = Duration::from_secs(5);

    async fn recv<T>(rx: &mut Receiver<T>) -> Option<T> {
        tokio::time::timeout(LIMIT, poll_fn(|cx| rx.poll_recv(cx)))
            .await
            .expect("an item or the end in time")
    }

    #[tokio::test]
    async fn items_arrive_in_order_and_the_end_after_the_last() {
        let (tx, mut rx) = queue(4);
        for i in 0..4 {
            tx.try_send(i).unwrap();
        }
        assert_eq!(tx.try_send(4), Err(TrySendError::Full(4)));
        drop(tx);
        for i in 0..4 {
            assert_eq!(recv(&mut rx).await, Some(i));
        }
        assert_eq!(recv(&mut rx).await, None);
    }

    #[tokio::test]
    async fn a_receiver_waiting_is_woken_by_a_send() {
        let (tx, mut rx) = queue(1);
        let waiting = tokio::spawn(async move { recv(&mut rx).await });
        tokio::task::yield_now().await;
        tx.try_send("a").unwrap();
        assert_eq!(tokio::time::timeout(LIMIT, waiting).await.unwrap().unwrap(), Some("a"));
    }

    #[tokio::test]
    async fn a_full_sender_waits_for_room_and_gets_it_in_order() {
        let (tx, mut rx) = queue(1);
        tx.try_send(1).unwrap();
        let sending = tokio::spawn(async move {
            tx.send(2).await.unwrap();
            tx
        });
        assert_eq!(recv(&mut rx).await, Some(1));
        let tx = tokio::time::timeout(LIMIT, sending).await.unwrap().unwrap();
        assert_eq!(recv(&mut rx).await, Some(2));
        drop(tx);
        assert_eq!(recv(&mut rx).await, None);
    }

    #[tokio::test]
    async fn the_sender_learns_that_the_receiver_went_and_what_was_queued_is_dropped() {
        let item = Arc::new(());
        let (tx, rx) = queue(1);
        tx.try_send(item.clone()).unwrap();
        let full = tokio::spawn(async move {
            let back = tx.send(Arc::new(())).await;
            tx.closed().await;
            (back.is_err(), tx.try_send(Arc::new(())))
        });
        tokio::task::yield_now().await;
        drop(rx);
        let (refused, after) = tokio::time::timeout(LIMIT, full).await.unwrap().unwrap();
        assert!(refused);
        assert!(matches!(after, Err(TrySendError::Closed(_))));
        assert_eq!(Arc::strong_count(&item), 1, "the queued item went with the receiver");
    }

    #[tokio::test]
    async fn an_idle_sender_waiting_for_the_end_is_not_woken_by_takes() {
        let (tx, mut rx) = queue(2);
        tx.try_send(1).unwrap();
        let mut closed = Box::pin(tx.closed());
        let counter = Arc::new(WakeCounter::default());
        let waker = Waker::from(counter.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(closed.as_mut().poll(&mut cx).is_pending());
        assert_eq!(recv(&mut rx).await, Some(1));
        assert_eq!(counter.wakes(), 0);
        drop(rx);
        assert_eq!(counter.wakes(), 1);
        assert!(closed.as_mut().poll(&mut cx).is_ready());
    }

    #[derive(Default)]
    struct WakeCounter(std::sync::atomic::AtomicUsize);

    impl WakeCounter {
        fn wakes(&self) -> usize {
            self.0.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    impl std::task::Wake for WakeCounter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}
