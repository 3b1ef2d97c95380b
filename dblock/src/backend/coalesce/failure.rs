//! A failed batch fails each of its rows the same way: the same text and `sent`, and the
//! class the backend gave the batch's failure, carried as a typed value ([`Failed::class`]).

use crate::retry::{Failed, Failure};

/// A failure of a batch, for one of its rows: same text, same `sent`, and classed as the
/// batch's failure was (`class`, by the backend's mapping), whatever the copy's type.
pub(crate) fn copy(failed: &Failed, class: Failure) -> Failed {
    let error = match &failed.error {
        sqlx::Error::Io(io) => sqlx::Error::Io(std::io::Error::new(io.kind(), io.to_string())),
        sqlx::Error::PoolTimedOut => sqlx::Error::PoolTimedOut,
        other => sqlx::Error::Database(Box::new(Replica {
            message: other.to_string(),
            code: match other {
                sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
                _ => None,
            },
        })),
    };
    Failed {
        error,
        sent: failed.sent,
        class: Some(class),
    }
}

/// A server (or other) error of a batch, as each of its rows reports it: the same message and
/// SQLSTATE (a caller still tells a missing table from a refused connection), since sqlx's
/// errors cannot be cloned. It carries no class: [`Failed::class`] does.
#[derive(Debug)]
struct Replica {
    message: String,
    code: Option<String>,
}

impl std::fmt::Display for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Replica {}

impl sqlx::error::DatabaseError for Replica {
    fn message(&self) -> &str {
        &self.message
    }

    fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
        self.code.as_deref().map(std::borrow::Cow::Borrowed)
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        sqlx::error::ErrorKind::Other
    }
}
