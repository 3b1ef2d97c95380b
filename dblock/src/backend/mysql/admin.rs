//! The operator's statements on MySQL and MariaDB and the last-writer read: the code every backend
//! but PostgreSQL shares (`backend/admin.rs`), run with this backend's texts (`sql.rs`).

#[allow(unused_imports)]
use super::*;

crate::backend::admin::shared_admin!(OnMySql, mysql, My, sqlx::MySql, sql.admin);
