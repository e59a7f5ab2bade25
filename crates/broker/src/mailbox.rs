//! A small bounded queue with one receiver, for the rare requests sent to a connection task
//! (takeover, disconnect).
//!
//! Every connection owns one, so what it costs while empty is paid per idle connection: one
//! allocation of about a hundred bytes, where a tokio `mpsc` channel allocates its shared state
//! and a first block of 32 slots up front (1.5 KiB per connection; decision 0026).
//!
//! Semantics are those of a bounded `tokio::sync::mpsc` channel as the broker used it:
//! [`Sender::try_send`] fails when the queue is full or the receiver is gone, and
//! [`Receiver::poll_recv`] yields what was queued, then `None` once every sender is dropped.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use crate::signal::Signal;

struct Shared<T> {
    state: Mutex<State<T>>,
    /// Wakes the receiver. A notification that comes while it does not wait is kept, so a wake-up
    /// between the receiver's check and its wait is not lost.
    wake: Signal,
}

struct State<T> {
    queue: VecDeque<T>,
    // Narrow counts keep the mailbox within a 96-byte allocation, paid by every connection.
    capacity: u16,
    senders: u32,
    receiver_alive: bool,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // Every update under this lock is a single queue or counter operation: a poisoned lock
        // still holds a consistent state.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Creates a mailbox that holds at most `capacity` requests.
pub(crate) fn channel<T>(capacity: u16) -> (Sender<T>, Receiver<T>) {
    debug_assert!(capacity > 0);
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            queue: VecDeque::new(),
            capacity,
            senders: 1,
            receiver_alive: true,
        }),
        wake: Signal::default(),
    });
    (
        Sender {
            shared: shared.clone(),
        },
        Receiver { shared },
    )
}

pub(crate) struct Sender<T> {
    shared: Arc<Shared<T>>,
}

/// Why [`Sender::try_send`] did not queue a request; the request is handed back.
#[derive(Debug)]
pub(crate) struct Full<T>(pub T);

impl<T> Sender<T> {
    /// Queues `value` unless the mailbox is full or its receiver is gone.
    pub(crate) fn try_send(&self, value: T) -> Result<(), Full<T>> {
        let mut state = self.shared.lock();
        if !state.receiver_alive || state.queue.len() >= usize::from(state.capacity) {
            return Err(Full(value));
        }
        state.queue.push_back(value);
        drop(state);
        self.shared.wake.notify();
        Ok(())
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        self.shared.lock().senders += 1;
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.senders -= 1;
        let last = state.senders == 0;
        drop(state);
        if last {
            self.shared.wake.notify();
        }
    }
}

pub(crate) struct Receiver<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Receiver<T> {
    /// The next request; `None` once the queue is empty and every sender is gone. Cancel-safe:
    /// a request is taken from the queue only when this returns it.
    #[cfg(test)]
    pub(crate) async fn recv(&mut self) -> Option<T> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// [`Receiver::recv`] as a poll: a connection waiting on its mailbox then holds no future for it.
    pub(crate) fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        loop {
            {
                let mut state = self.shared.lock();
                if let Some(value) = state.queue.pop_front() {
                    return Poll::Ready(Some(value));
                }
                if state.senders == 0 {
                    return Poll::Ready(None);
                }
            }
            // Ready when something was sent (or the last sender dropped) since the check: look again.
            if self.shared.wake.poll_wait(cx).is_pending() {
                return Poll::Pending;
            }
        }
    }

    /// The next request if one is queued (tests).
    #[cfg(test)]
    pub(crate) fn try_recv(&mut self) -> Option<T> {
        self.shared.lock().queue.pop_front()
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.receiver_alive = false;
        // Requests nobody will read (e.g. a takeover's `done` sender) are dropped now, so whoever
        // waits on them learns at once.
        let queued = std::mem::take(&mut state.queue);
        drop(state);
        drop(queued);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn delivers_in_order_then_none_when_senders_are_gone() {
        let (tx, mut rx) = channel(4);
        let tx2 = tx.clone();
        tx.try_send(1).unwrap();
        tx2.try_send(2).unwrap();
        drop(tx);
        drop(tx2);
        assert_eq!(rx.recv().await, Some(1));
        assert_eq!(rx.recv().await, Some(2));
        assert_eq!(rx.recv().await, None);
    }

    #[tokio::test]
    async fn refuses_when_full_or_when_the_receiver_is_gone() {
        let (tx, rx) = channel(2);
        tx.try_send(1).unwrap();
        tx.try_send(2).unwrap();
        assert_eq!(tx.try_send(3).unwrap_err().0, 3);
        drop(rx);
        assert_eq!(tx.try_send(4).unwrap_err().0, 4);
    }

    #[tokio::test]
    async fn a_waiting_receiver_wakes_on_send_and_on_the_last_drop() {
        let (tx, mut rx) = channel(1);
        let waiter = tokio::spawn(async move {
            let first = rx.recv().await;
            let second = rx.recv().await;
            (first, second)
        });
        tokio::task::yield_now().await;
        tx.try_send("takeover").unwrap();
        tokio::task::yield_now().await;
        drop(tx);
        assert_eq!(waiter.await.unwrap(), (Some("takeover"), None));
    }

    #[test]
    fn costs_one_small_allocation() {
        // What an idle connection pays for its mailbox (plus the allocator's rounding).
        // 96 bytes (the allocator's size class) with the reference counts.
        assert!(std::mem::size_of::<Shared<crate::registry::Control>>() <= 80);
    }
}
