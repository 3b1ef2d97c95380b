//! The operator's statements on PostgreSQL (with the migration probes and the queue read of
//! `backend/operator.rs`) and the last-writer read: its own texts through its
//! own runner (which knows the form a transaction pooler needs), the decoders shared with the
//! other backends (`backend/admin.rs`).

#[allow(unused_imports)]
use super::*;
use crate::backend::admin::{decode, decode_last_write};
use crate::backend::operator::{Probes, Queue, QueueRow};
use crate::backend::*;
use crate::info::LockInfo;

/// Every row decoded as a [`LockInfo`].
fn infos(rows: &[PgRow]) -> sqlx::Result<Vec<LockInfo>> {
    rows.iter().map(decode).collect()
}

async fn last_write(
    pg: &Pg,
    c: &mut PgConnection,
    s: &LastWriteOf<'_>,
) -> sqlx::Result<Option<LastWrite>> {
    let row = pg
        .send::<Option<PgRow>>(c, &pg.sql.last_write, &[Arg::Text(s.0)])
        .await?;
    row.as_ref().map(decode_last_write).transpose()
}

async fn inspect(pg: &Pg, c: &mut PgConnection, s: &Inspect<'_>) -> sqlx::Result<Option<LockInfo>> {
    let row = pg
        .send::<Option<PgRow>>(c, &pg.sql.inspect, &[Arg::Text(s.0)])
        .await?;
    row.as_ref().map(decode).transpose()
}

async fn live(pg: &Pg, c: &mut PgConnection, _: &LiveRows) -> sqlx::Result<Vec<LockInfo>> {
    infos(&pg.send::<Vec<PgRow>>(c, &pg.sql.held, &[]).await?)
}

async fn rows_in(pg: &Pg, c: &mut PgConnection, s: &RowsIn<'_>) -> sqlx::Result<Vec<LockInfo>> {
    let args = [
        Arg::Text(s.from),
        Arg::Text(s.to),
        Arg::Int8(s.taken_within_us),
    ];
    infos(&pg.send::<Vec<PgRow>>(c, &pg.sql.rows_in, &args).await?)
}

async fn force_release(pg: &Pg, c: &mut PgConnection, s: &ForceRelease<'_>) -> sqlx::Result<bool> {
    Ok(pg
        .send::<Changed>(
            c,
            &pg.sql.force_release,
            &[Arg::Text(s.key), Arg::Text(s.owner)],
        )
        .await?
        .0
        > 0)
}

async fn reset(pg: &Pg, c: &mut PgConnection, s: &Reset<'_>) -> sqlx::Result<bool> {
    Ok(pg
        .send::<Changed>(c, &pg.sql.reset, &[Arg::Text(s.0)])
        .await?
        .0
        > 0)
}

/// In batches of at most [`PURGE_BATCH`] rows, until a batch comes back short; then how long
/// the rows kept for their fencing token alone are held back.
async fn purge(pg: &Pg, c: &mut PgConnection, s: &Purge) -> sqlx::Result<Purged> {
    let age = [Arg::Int8(s.older_than_us)];
    let mut deleted = 0;
    loop {
        let n = pg.send::<Changed>(c, &pg.sql.purge, &age).await?.0;
        deleted += n;
        if n < PURGE_BATCH {
            break;
        }
    }
    let row = pg.send::<Option<PgRow>>(c, &pg.sql.held_back, &age).await?;
    let held_back_us = match row {
        Some(row) => row.try_get(0)?,
        None => None,
    };
    Ok(Purged {
        deleted,
        held_back_us,
    })
}

async fn probe(_: &Pg, c: &mut PgConnection, s: &Probes<'_>) -> sqlx::Result<Vec<bool>> {
    // undefined_table, undefined_column, invalid_schema_name.
    let missing = |e: &dyn sqlx::error::DatabaseError| {
        matches!(e.code().as_deref(), Some("42P01" | "42703" | "3F000"))
    };
    s.run::<sqlx::Postgres>(c, '"', missing).await
}

async fn queue(_: &Pg, c: &mut PgConnection, s: &Queue<'_>) -> sqlx::Result<Vec<QueueRow>> {
    let text = "SELECT lock_key, ticket, owner, (extract(epoch FROM expires_at) * 1000000)::int8,
                greatest(0, ceil(extract(epoch FROM expires_at - statement_timestamp()) * 1000))::int8
         FROM {table} WHERE expires_at > statement_timestamp() ORDER BY lock_key, ticket";
    s.run::<sqlx::Postgres>(c, text, '"').await
}

crate::backend::runs! {
    OnPostgres, postgres, Pg, PgConnection;
    Probes<'_> => probe,
    Queue<'_> => queue,
    LastWriteOf<'_> => last_write,
    Inspect<'_> => inspect,
    LiveRows => live,
    RowsIn<'_> => rows_in,
    ForceRelease<'_> => force_release,
    Reset<'_> => reset,
    Purge => purge,
}
