//! The test kit's hooks as the backend sees them: what a test locker's statements should
//! suffer next, and one statement's passage with the paused clock held still. A leaf: the
//! backend's executor consults it, and it names nothing of the locker.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::retry::Failed;

/// What a test locker's statements should suffer next (see [`fail_next`](super::fail_next),
/// [`lose_next_replies`](super::lose_next_replies)).
#[derive(Debug, Default)]
pub(crate) struct Faults {
    pub(super) fail: AtomicU32,
    pub(super) lost: AtomicU32,
}

/// Takes one from `count` unless it is zero; whether it did.
fn take_one(count: &AtomicU32) -> bool {
    count
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

/// One statement of a test locker, from before its connection to its reply: the paused clock
/// stands still meanwhile, and it may have been told its reply is lost.
pub(crate) struct Statement {
    _still: Option<Still>,
    reply_lost: bool,
}

impl Statement {
    /// Begins a statement on connections with `faults` (none: not a test locker's, nothing
    /// changes). `Err`: the statement fails unsent (see [`fail_next`](super::fail_next)).
    pub(crate) fn begin(faults: Option<&Arc<Faults>>) -> Result<Statement, Failed> {
        let Some(faults) = faults else {
            return Ok(Statement {
                _still: None,
                reply_lost: false,
            });
        };
        if take_one(&faults.fail) {
            return Err(Failed {
                error: sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "connection lost (injected by dblock::testing::fail_next)",
                )),
                sent: false,
                class: None,
            });
        }
        Ok(Statement {
            _still: Some(Still::new()),
            reply_lost: take_one(&faults.lost),
        })
    }

    /// Whether the statement's reply is to be lost (see
    /// [`lose_next_replies`](super::lose_next_replies)).
    pub(crate) fn reply_lost(&self) -> bool {
        self.reply_lost
    }
}

/// While one lives, tokio's paused clock does not jump ahead to its next timer when the runtime
/// has nothing to run: a blocking task that waits for it to drop tells the runtime that work is
/// under way (tokio inhibits its auto-advance while a blocking task runs). Nothing outside a
/// current-thread runtime with a paused clock notices it.
pub(crate) struct Still {
    _running: Option<std::sync::mpsc::Sender<()>>,
}

impl Still {
    pub(crate) fn new() -> Still {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return Still { _running: None };
        };
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        rt.spawn_blocking(move || {
            // Returns when the sender drops.
            let _ = rx.recv();
        });
        Still { _running: Some(tx) }
    }
}
