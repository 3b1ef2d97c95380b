//! Fast hand-off on PostgreSQL: one LISTEN connection per [`Locker`](crate::Locker) turns a
//! release into an immediate retry for a waiter in this process, instead of its next poll.
//!
//! Cost control: a release sends NOTIFY only when the row's `contended` flag is set, and only a
//! waiter sets it (once per contention episode, and only after its LISTEN is in place); the next
//! acquisition clears it. An uncontended lock/unlock cycle never notifies. A notification lost
//! while the listener reconnects costs at most one backoff poll: waiters keep polling.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use tokio::sync::{Notify, OnceCell};

/// Where the LISTEN connection goes.
#[derive(Clone, Debug)]
pub(crate) enum Source {
    /// Where the locker's pool connects (read when LISTEN starts). Only its connect options are
    /// used: LISTEN has a connection of its own, never one of the pool's.
    Pool(PgPool),
    /// A URL of its own: straight to the server when the pool goes through a transaction pooler
    /// (a LISTEN there would be registered on whichever server connection ran it, and stay
    /// there when the pooler hands that connection to another client).
    Direct(Arc<PgConnectOptions>),
}

impl Source {
    fn connect_options(&self) -> PgConnectOptions {
        match self {
            Source::Pool(pool) => (*pool.connect_options()).clone(),
            Source::Direct(options) => (**options).clone(),
        }
    }
}

/// The waiters of one locker, by key, and its listening connection.
pub(crate) struct Notifier {
    source: Source,
    channel: String,
    waiters: Mutex<HashMap<String, Waiter>>,
    listening: OnceCell<bool>,
    /// The task reading notifications, so that `stop` ends it (and its connection) at once.
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

struct Waiter {
    notify: Arc<Notify>,
    count: usize,
}

/// Interest in one key; dropping it withdraws the interest.
pub(crate) struct Interest {
    notifier: Arc<Notifier>,
    key: String,
    pub(crate) notify: Arc<Notify>,
}

impl Drop for Interest {
    fn drop(&mut self) {
        let mut waiters = self.notifier.lock();
        if let Some(w) = waiters.get_mut(&self.key) {
            w.count -= 1;
            if w.count == 0 {
                waiters.remove(&self.key);
            }
        }
    }
}

impl Notifier {
    pub(crate) fn new(source: Source, channel: String) -> Arc<Self> {
        Arc::new(Notifier {
            source,
            channel,
            waiters: Mutex::default(),
            listening: OnceCell::new(),
            task: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Waiter>> {
        self.waiters
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Starts the listener (once) and registers interest in `key`. `None` when LISTEN could not
    /// be set up: the caller then just polls.
    pub(crate) async fn interest(self: &Arc<Self>, key: &str) -> Option<Interest> {
        let ready = *self
            .listening
            .get_or_init(|| async {
                // Boxed: connecting is a large future, needed once, and a waiter's own future
                // should not carry its size.
                match Box::pin(self.listen()).await {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!(error = %e, "LISTEN failed; waiters fall back to polling");
                        false
                    }
                }
            })
            .await;
        if !ready {
            return None;
        }
        let mut waiters = self.lock();
        let w = waiters.entry(key.to_owned()).or_insert_with(|| Waiter {
            notify: Arc::new(Notify::new()),
            count: 0,
        });
        w.count += 1;
        Some(Interest {
            notifier: self.clone(),
            key: key.to_owned(),
            notify: w.notify.clone(),
        })
    }

    /// LISTENs on a connection of its own, opened with the pool's connect options (or the direct
    /// URL's) but never taken out of the pool (which is the caller's, for
    /// `Locker::postgres(pool)`), then hands it to a task that wakes one waiter of the released
    /// key per notification.
    async fn listen(self: &Arc<Self>) -> Result<(), sqlx::Error> {
        let own = PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with(self.source.connect_options());
        let mut listener = PgListener::connect_with(&own).await?;
        listener.listen(&self.channel).await?;
        let me: Weak<Notifier> = Arc::downgrade(self);
        let task = tokio::spawn(async move {
            loop {
                // `recv` reconnects (and LISTENs again) by itself after a lost connection.
                let received = listener.recv().await;
                let Some(notifier) = me.upgrade() else { break };
                match received {
                    Ok(n) => {
                        if let Some(w) = notifier.lock().get(n.payload()) {
                            // One waiter per process: no thundering herd on release.
                            w.notify.notify_one();
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "listener connection lost; reconnecting");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                }
            }
        });
        *self
            .task
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(task);
        Ok(())
    }

    /// Stops listening for good (`Locker::shutdown`); waiters fall back to polling.
    pub(crate) fn stop(&self) {
        let _ = self.listening.set(false);
        if let Some(task) = self
            .task
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier")
            .field("channel", &self.channel)
            .finish_non_exhaustive()
    }
}
