//! A wake-up for a single waiter: the owning connection. It replaces `tokio::sync::Notify` where only
//! one task ever waits, because a parked connection pays for every future it waits on: a
//! `Notified` is a 64-byte list node held in the connection's task while it waits, where waiting on
//! a [`Signal`] holds only a reference (the waker is stored in the signal itself).
//!
//! Semantics are those of `Notify::notify_one` with one waiter: a notification that comes while
//! nobody waits is kept (one, not counted) and consumed by the next wait.

use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use futures::task::AtomicWaker;

#[derive(Default)]
pub(crate) struct Signal {
    set: AtomicBool,
    waker: AtomicWaker,
}

impl Signal {
    /// Wakes the waiter, or the next one to wait.
    pub(crate) fn notify(&self) {
        self.set.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Consumes a pending notification, if there is one.
    pub(crate) fn take(&self) -> bool {
        self.set.swap(false, Ordering::AcqRel)
    }

    /// Ready once notified (consuming the notification). Only the last task to poll is woken.
    pub(crate) fn poll_wait(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.take() {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        // A notification between the check and the registration woke the previous waker, if any.
        if self.take() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// Waits until notified. Cancel-safe: a notification is consumed only when this completes.
    #[cfg(test)]
    pub(crate) async fn wait(&self) {
        std::future::poll_fn(|cx| self.poll_wait(cx)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[tokio::test]
    async fn a_notification_before_the_wait_is_kept_once() {
        let signal = Signal::default();
        signal.notify();
        signal.notify();
        assert!(signal.wait().now_or_never().is_some());
        assert!(signal.wait().now_or_never().is_none());
    }

    #[tokio::test]
    async fn a_waiting_task_wakes_on_notify() {
        let signal = std::sync::Arc::new(Signal::default());
        let waiter = tokio::spawn({
            let signal = signal.clone();
            async move { signal.wait().await }
        });
        tokio::task::yield_now().await;
        signal.notify();
        waiter.await.unwrap();
        assert!(!signal.take());
    }

    #[test]
    fn waiting_holds_no_more_than_a_reference() {
        let signal = Signal::default();
        assert!(std::mem::size_of_val(&signal.wait()) <= 32);
    }
}
