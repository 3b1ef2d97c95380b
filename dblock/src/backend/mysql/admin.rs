//! The operator's statements on MySQL and MariaDB and the last-writer read: the code every backend
//! but PostgreSQL shares (`backend/admin.rs`), run with this backend's texts (`sql.rs`); the
//! migration probes and the queue read of `backend/operator.rs`.

#[allow(unused_imports)]
use super::*;

use crate::backend::operator::{Probes, Queue, QueueRow};

crate::backend::admin::shared_admin!(OnMySql, mysql, My, sqlx::MySql, sql.admin);

async fn probe(_: &My, c: &mut MySqlConnection, s: &Probes<'_>) -> sqlx::Result<Vec<bool>> {
    // ER_NO_SUCH_TABLE (SQLSTATE 42S02), ER_BAD_FIELD_ERROR (42S22).
    let missing =
        |e: &dyn sqlx::error::DatabaseError| matches!(e.code().as_deref(), Some("42S02" | "42S22"));
    s.run::<sqlx::MySql>(c, '`', missing).await
}

async fn queue(_: &My, c: &mut MySqlConnection, s: &Queue<'_>) -> sqlx::Result<Vec<QueueRow>> {
    // Keys are binary; dblock only writes keys that came from a Rust `&str` (valid UTF-8).
    let text = "SELECT CONVERT(lock_key USING utf8mb4), ticket, owner,
                TIMESTAMPDIFF(MICROSECOND, '1970-01-01', expires_at),
                GREATEST(0, (TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) + 999) DIV 1000)
         FROM {table} WHERE expires_at > UTC_TIMESTAMP(6) ORDER BY lock_key, ticket";
    s.run::<sqlx::MySql>(c, text, '`').await
}

crate::backend::runs! {
    OnMySql, mysql, My, MySqlConnection;
    Probes<'_> => probe,
    Queue<'_> => queue,
}
