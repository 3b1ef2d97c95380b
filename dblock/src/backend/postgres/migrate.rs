//! The schema on PostgreSQL: the statements of the migration files, applied in order.

#[allow(unused_imports)]
use super::*;
use crate::backend::*;

impl OnPostgres for Migrate {
    async fn postgres(&self, pg: &Pg, conn: &mut PgConnection) -> sqlx::Result<()> {
        // The usual case at every start: the table is there, with the newest migration's
        // columns. One read, no lock, and none of the "already exists, skipping" NOTICEs that
        // sqlx would log at INFO.
        let exists: bool = match pg
            .send::<Option<PgRow>>(
                conn,
                &pg.sql.exists,
                &[Arg::Text(&pg.sql.queue_table), Arg::Text(&pg.sql.table)],
            )
            .await?
        {
            Some(row) => row.try_get(0)?,
            None => false,
        };
        if exists {
            return Ok(());
        }
        // `CREATE TABLE IF NOT EXISTS` is not safe against itself: two sessions can both pass the
        // "exists?" check and one dies on pg_type's unique index. A transaction-scoped advisory
        // lock makes concurrent migrations queue instead; the ones that queued then find the
        // table made, quietly.
        if let Some(p) = pg.settings.pooler.pooler() {
            // Behind a pooler: the same steps as one simple query, which is one implicit
            // transaction (no explicit one to leave open on a shared server connection, and
            // fine in statement pooling mode too).
            let mut script = format!(
                "{}{MIGRATE_LOCK};\nSET LOCAL client_min_messages = warning;\n",
                p.prefix()
            );
            for statement in pg.sql.schema.in_order() {
                script.push_str(statement.as_str());
            }
            sqlx::raw_sql(AssertSqlSafe(script)).execute(conn).await?;
            return Ok(());
        }
        let mut tx = conn.begin().await?;
        sqlx::query(MIGRATE_LOCK).execute(&mut *tx).await?;
        sqlx::query("SET LOCAL client_min_messages = warning")
            .execute(&mut *tx)
            .await?;
        for statement in pg.sql.schema.in_order() {
            sqlx::raw_sql(statement.clone()).execute(&mut *tx).await?;
        }
        tx.commit().await
    }
}
