//! The operator's statements on SQLite and the last-writer read: the code every backend but
//! PostgreSQL shares (`backend/admin.rs`), run with this backend's texts (`sql.rs`).

#[allow(unused_imports)]
use super::*;

crate::backend::admin::shared_admin!(OnSqlite, sqlite, Lite, sqlx::Sqlite, sql.admin);
