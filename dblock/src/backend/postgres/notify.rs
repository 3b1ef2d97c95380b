//! Fast hand-off on PostgreSQL: one LISTEN connection per [`Locker`](crate::Locker) turns a
//! release into an immediate retry for a waiter in this process, instead of its next poll.
//!
//! Cost control: a release sends NOTIFY only when the row's `contended` flag is set, and only a
//! waiter sets it (once per contention episode, and only after its LISTEN is in place); the next
//! acquisition clears it. An uncontended lock/unlock cycle never notifies. A notification lost
//! while the listener reconnects costs at most one backoff poll: waiters keep polling.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::sync::lock;

/// The longest a LISTEN connection may take to open; waiters poll meanwhile.
const LISTEN_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// After a LISTEN that could not be set up, the next waiter tries again this much later.
const LISTEN_RETRY_AFTER: Duration = Duration::from_secs(10);

/// Where the LISTEN connection goes.
#[derive(Clone)]
pub(crate) enum Source {
    /// Where the locker's pool connects (read when LISTEN starts). Only its connect options are
    /// used: LISTEN has a connection of its own, never one of the pool's.
    Pool(PgPool),
    /// A URL of its own: straight to the server when the pool goes through a transaction pooler
    /// (a LISTEN there would be registered on whichever server connection ran it, and stay
    /// there when the pooler hands that connection to another client).
    Direct(Arc<PgConnectOptions>),
}

/// Without the connect options: they hold the password.
impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Source::Pool(_) => "Source::Pool",
            Source::Direct(_) => "Source::Direct",
        })
    }
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
    /// Whether LISTEN is in place, or being set up.
    listening: Mutex<Listening>,
    /// Set by `stop`: no LISTEN from then on.
    stopped: AtomicBool,
    /// The task reading notifications, so that `stop` ends it (and its connection) at once.
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

enum Listening {
    /// Not yet, or failed: the first waiter from `retry_at` on starts it (again).
    No {
        retry_at: Option<Instant>,
    },
    /// Being set up, in a task of its own: waiters poll meanwhile.
    Connecting,
    Yes,
    /// Never: the pool's server connections are shared (a transaction pooler), where a LISTEN
    /// would stay behind on a server connection other clients get next. Waiters poll.
    Off,
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
            listening: Mutex::new(Listening::No { retry_at: None }),
            stopped: AtomicBool::new(false),
            task: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Waiter>> {
        lock(&self.waiters)
    }

    /// Registers interest in `key` if LISTEN is in place. Otherwise `None` (the caller polls),
    /// and the first waiter starts setting LISTEN up in a task of its own, so no waiter ever
    /// waits for it: one that could not be set up (server unreachable: at most
    /// [`LISTEN_CONNECT_TIMEOUT`]) is started again by a waiter [`LISTEN_RETRY_AFTER`] later.
    pub(crate) async fn interest(self: &Arc<Self>, key: &str) -> Option<Interest> {
        if self.stopped.load(Ordering::SeqCst) {
            return None;
        }
        {
            let mut listening = lock(&self.listening);
            match *listening {
                Listening::Yes => {}
                Listening::Connecting | Listening::Off => return None,
                Listening::No { retry_at } => {
                    if retry_at.is_some_and(|at| Instant::now() < at) {
                        return None;
                    }
                    *listening = Listening::Connecting;
                    let me = self.clone();
                    tokio::spawn(async move {
                        let listened =
                            tokio::time::timeout(2 * LISTEN_CONNECT_TIMEOUT, me.listen()).await;
                        let state = match listened {
                            Ok(Ok(true)) => Listening::Yes,
                            Ok(Ok(false)) => Listening::Off,
                            failed => {
                                let error = match failed {
                                    Ok(Err(e)) => e.to_string(),
                                    _ => "LISTEN timed out".to_owned(),
                                };
                                tracing::warn!(%error, retry_in = ?LISTEN_RETRY_AFTER,
                                    "LISTEN failed; waiters fall back to polling");
                                Listening::No {
                                    retry_at: Some(Instant::now() + LISTEN_RETRY_AFTER),
                                }
                            }
                        };
                        *lock(&me.listening) = state;
                    });
                    return None;
                }
            }
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
    ///
    /// Through the pool's own connect options (`Locker::postgres(pool)`), it first makes sure
    /// that they reach a server, not a transaction pooler: when in doubt, no LISTEN (`Ok(false)`,
    /// said once at `info`), since a LISTEN through such a pooler stays on whichever server
    /// connection ran it and its notifications then reach other clients, who cannot read them.
    /// A `listen_url` is the caller's word that it goes straight to the server.
    async fn listen(self: &Arc<Self>) -> sqlx::Result<bool> {
        let options = self.source.connect_options();
        if matches!(self.source, Source::Pool(_)) && super::state_shared(&options).await? {
            tracing::info!(
                "no LISTEN: the pool's server connections are shared between clients (a transaction \
                 pooler); waiters poll. ConnectOptions::listen_url gives LISTEN a direct connection"
            );
            return Ok(false);
        }
        let own = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(LISTEN_CONNECT_TIMEOUT)
            .connect_lazy_with(options);
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
        *lock(&self.task) = Some(task);
        if self.stopped.load(Ordering::SeqCst) {
            self.abort_task(); // stopped while this was connecting
        }
        Ok(true)
    }

    /// Stops listening for good (`Locker::shutdown`); waiters fall back to polling.
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        self.abort_task();
    }

    fn abort_task(&self) {
        if let Some(task) = lock(&self.task).take() {
            task.abort();
        }
    }
}

/// The locker (every clone, every `table()` copy and guard) is gone: its LISTEN connection goes
/// with it, now, not at the next notification.
impl Drop for Notifier {
    fn drop(&mut self) {
        self.abort_task();
    }
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier")
            .field("channel", &self.channel)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    /// The state LISTEN settles in for `source`, set up by a first waiter.
    async fn settles(source: Source) -> &'static str {
        let notifier = Notifier::new(source, "dblock_test_probe".into());
        assert!(
            notifier.interest("k").await.is_none(),
            "set up in the background"
        );
        for _ in 0..100 {
            match *lock(&notifier.listening) {
                Listening::Yes => return "yes",
                Listening::Off => return "off",
                Listening::No { .. } => return "failed",
                Listening::Connecting => {}
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        "still connecting"
    }

    /// `Locker::postgres(pool)` with a pool that goes through a transaction pooler never LISTENs
    /// there (it polls); with a pool straight to the server, it does; a direct `listen_url` is
    /// taken at its word.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_listen_through_a_transaction_pooler() {
        let require = crate::backend::servers_required();
        let options = crate::backend::postgres::tests::plain_options;
        let pool = |url: &str| PgPool::connect_lazy_with(options(url));
        let server = "postgres://postgres@127.0.0.1:5432/test";
        let bouncer = "postgres://postgres@127.0.0.1:6432/test";
        let direct = settles(Source::Pool(pool(server))).await;
        if direct == "failed" && !require {
            return; // no server here
        }
        assert_eq!(direct, "yes");
        assert_eq!(settles(Source::Pool(pool(bouncer))).await, "off");
        assert_eq!(
            settles(Source::Direct(Arc::new(options(server)))).await,
            "yes"
        );
    }
}
