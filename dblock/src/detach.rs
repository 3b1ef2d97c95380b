//! Cancellation safety without a task per statement: a future its caller polls inline that,
//! if the caller drops it before it completes, finishes in a task of its own.
//!
//! A lock statement must never be abandoned half-way: sqlx would leave it on the pooled
//! connection to run whenever that connection is next used, and a grant (or a release) nobody
//! hears of would orphan a hold until its ttl. Spawning every statement into a task of its own
//! gives that safety, but costs a hand-off between threads and back on every acquire and
//! release (measured: about a tenth of an uncontended PostgreSQL lock cycle). [`Detached`] runs
//! the statement in the caller's own task, and only a caller that goes away (a timeout,
//! `select!`, a dropped `lock()` future) hands what is left of it to a task, which then settles
//! it as the caller would have: the output goes to [`Unreceived::unreceived`].

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tracing::Instrument;

/// What to do with the output of a [`Detached`] future whose caller went away.
pub(crate) trait Unreceived: Send + 'static {
    /// Settles the output nobody received (e.g. gives a grant back).
    fn unreceived(self) -> impl Future<Output = ()> + Send;
}

/// A future polled inline; dropped before completion, it is finished in a task of its own on
/// the current tokio runtime and its output settled by [`Unreceived::unreceived`]. (Outside a
/// runtime it is dropped: callers check for a runtime before they start one.)
pub(crate) struct Detached<F: Future<Output: Unreceived> + Send + 'static> {
    fut: Option<Pin<Box<F>>>,
    /// The caller's span, for what the task logs.
    span: tracing::Span,
}

impl<F: Future<Output: Unreceived> + Send + 'static> Detached<F> {
    pub(crate) fn new(fut: F) -> Self {
        Detached {
            fut: Some(Box::pin(fut)),
            span: tracing::Span::current(),
        }
    }
}

impl<F: Future<Output: Unreceived> + Send + 'static> Future for Detached<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // Out of `self` while it runs: a statement future that panics is dropped with the
        // unwinding, never handed to a task by `Drop` (where polling it again would panic once
        // more, "`async fn` resumed after panicking").
        let Some(mut fut) = self.fut.take() else {
            // Polled again after it completed: it never completes twice.
            return Poll::Pending;
        };
        match fut.as_mut().poll(cx) {
            Poll::Ready(out) => Poll::Ready(out),
            Poll::Pending => {
                self.fut = Some(fut);
                Poll::Pending
            }
        }
    }
}

impl<F: Future<Output: Unreceived> + Send + 'static> Drop for Detached<F> {
    fn drop(&mut self) {
        let Some(fut) = self.fut.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let span = std::mem::replace(&mut self.span, tracing::Span::none());
                rt.spawn(async move { fut.await.unreceived().await }.instrument(span));
            }
            Err(_) => tracing::warn!(
                "a lock statement was dropped outside a tokio runtime; what it did is left to expire"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    struct Count(Arc<AtomicUsize>);

    impl Unreceived for Count {
        async fn unreceived(self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    async fn slow(done: Arc<AtomicUsize>, seen: Arc<AtomicUsize>) -> Count {
        tokio::time::sleep(Duration::from_millis(50)).await;
        done.fetch_add(1, Ordering::SeqCst);
        Count(seen)
    }

    /// Panics when first polled; polled again, says so (where an `async fn` would panic with
    /// "resumed after panicking").
    struct PanicsOnce {
        polled: bool,
        resumed: Arc<AtomicUsize>,
    }

    impl Future for PanicsOnce {
        type Output = Count;

        fn poll(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Count> {
            if std::mem::replace(&mut self.polled, true) {
                self.resumed.fetch_add(1, Ordering::SeqCst);
                return Poll::Pending;
            }
            panic!("a statement future panicked");
        }
    }

    #[tokio::test]
    async fn a_future_that_panicked_is_not_run_again_when_dropped() {
        let resumed = Arc::new(AtomicUsize::new(0));
        let mut detached = Box::pin(Detached::new(PanicsOnce {
            polled: false,
            resumed: Arc::clone(&resumed),
        }));
        let waker = std::task::Waker::noop();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = detached.as_mut().poll(&mut Context::from_waker(waker));
        }));
        assert!(panicked.is_err());
        drop(detached);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            resumed.load(Ordering::SeqCst),
            0,
            "polled again after its panic"
        );
    }

    /// Polled to the end, the output is the caller's; dropped half-way, the rest runs in a task
    /// and the output is settled there.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_future_is_finished_and_settled_elsewhere() {
        let (done, unreceived) = (Arc::default(), Arc::new(AtomicUsize::new(0)));
        let out = Detached::new(slow(Arc::clone(&done), Arc::clone(&unreceived))).await;
        assert_eq!(
            (
                done.load(Ordering::SeqCst),
                unreceived.load(Ordering::SeqCst)
            ),
            (1, 0)
        );
        drop(out);

        let cut = tokio::time::timeout(
            Duration::from_millis(10),
            Detached::new(slow(Arc::clone(&done), Arc::clone(&unreceived))),
        )
        .await;
        assert!(cut.is_err(), "the caller went away first");
        assert_eq!(done.load(Ordering::SeqCst), 1, "not finished yet");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            (
                done.load(Ordering::SeqCst),
                unreceived.load(Ordering::SeqCst)
            ),
            (2, 1),
            "finished in a task of its own, and its output settled"
        );
    }
}
