//! The operator's statements on SQLite and the last-writer read: the code every backend but
//! PostgreSQL shares (`backend/admin.rs`), run with this backend's texts (`sql.rs`); the
//! migration probes and the queue read of `backend/operator.rs`.

#[allow(unused_imports)]
use super::*;

use crate::backend::operator::{Probes, Queue, QueueRow};

crate::backend::admin::shared_admin!(OnSqlite, sqlite, Lite, sqlx::Sqlite, sql.admin);

async fn probe(_: &Lite, c: &mut SqliteConnection, s: &Probes<'_>) -> sqlx::Result<Vec<bool>> {
    // A plain SQLITE_ERROR, told by its message.
    let missing = |e: &dyn sqlx::error::DatabaseError| {
        e.message().starts_with("no such table") || e.message().starts_with("no such column")
    };
    s.run::<sqlx::Sqlite>(c, '"', missing).await
}

async fn queue(_: &Lite, c: &mut SqliteConnection, s: &Queue<'_>) -> sqlx::Result<Vec<QueueRow>> {
    // Times are whole milliseconds since the epoch (the clock of the process).
    let text = "SELECT lock_key, ticket, owner, expires_at * 1000, max(0, expires_at - {now})
         FROM {table} WHERE expires_at > {now} ORDER BY lock_key, ticket"
        .replace("{now}", super::NOW);
    s.run::<sqlx::Sqlite>(c, &text, '"').await
}

crate::backend::runs! {
    OnSqlite, sqlite, Lite, SqliteConnection;
    Probes<'_> => probe,
    Queue<'_> => queue,
}
