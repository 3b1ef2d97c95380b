//! The schema on MySQL and MariaDB: the statements of the migration files, applied in order.

#[allow(unused_imports)]
use super::*;
use crate::backend::*;

impl OnMySql for Migrate {
    async fn mysql(&self, my: &My, conn: &mut MySqlConnection) -> sqlx::Result<()> {
        // The usual case: table and the newest migration's queue table there. One read,
        // nothing written.
        if sqlx::query(my.sql.has_queue.clone())
            .execute(&mut *conn)
            .await
            .is_ok()
        {
            return Ok(());
        }
        // CREATE TABLE IF NOT EXISTS is serialised by the metadata lock: safe from many processes.
        let schema = &my.sql.schema;
        sqlx::raw_sql(schema.create.clone())
            .execute(&mut *conn)
            .await?;
        // Migrations 0002, 0003, 0006 and 0007 (MySQL 8 has no ADD COLUMN IF NOT EXISTS; each ALTER
        // adds all its columns or none): a column already there, added before or by a racing
        // process, is fine (1060, duplicate column).
        for add in &schema.columns {
            match sqlx::raw_sql(add.clone()).execute(&mut *conn).await {
                Err(sqlx::Error::Database(e))
                    if e.try_downcast_ref::<MySqlDatabaseError>()
                        .is_some_and(|e| e.number() == code::ER_DUP_FIELDNAME) => {}
                other => {
                    other?;
                }
            }
        }
        // Migration 0004, IF NOT EXISTS as the table's own.
        sqlx::raw_sql(schema.queue.clone())
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}
