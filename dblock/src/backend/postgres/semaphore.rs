//! Semaphores on PostgreSQL: the waiters' request for a NOTIFY (`backend/semaphore.rs`).

use sqlx::postgres::PgConnection;

use super::{stmt, Arg, Changed, Pg, Stmt};
use crate::backend::kind_sql::KindSql;
use crate::backend::semaphore::FlagSlots;

/// `$1`: the slot keys. One UPDATE of the live slots among them not flagged yet (a slot taken
/// anew clears its flag: the lock's acquire keeps it only for its own re-entry).
const FLAG: &str = "UPDATE {table} SET contended = true
WHERE lock_key = ANY($1::text[]) AND NOT contended
  AND owner IS NOT NULL AND expires_at > statement_timestamp()";

/// The statement's text on one table, built on first use.
pub(crate) struct Flag(Stmt);

impl KindSql for Flag {
    fn build(table: &str) -> Flag {
        Flag(stmt(FLAG, table))
    }
}

pub(crate) async fn flag_slots(
    pg: &Pg,
    conn: &mut PgConnection,
    f: &FlagSlots<'_>,
) -> sqlx::Result<()> {
    let keys: Vec<&str> = f.keys.iter().map(String::as_str).collect();
    let flag = pg.kind_sql.get::<Flag>();
    pg.send::<Changed>(conn, &flag.0, &[Arg::TextArray(&keys)])
        .await?;
    Ok(())
}

crate::backend::runs! {
    super::OnPostgres, postgres, super::Pg, sqlx::PgConnection;
    FlagSlots<'_> => flag_slots,
}
