-- dblock lock table for PostgreSQL: the same DDL Locker::migrate() runs.
-- For teams that apply migrations with their own tool. To use another table name,
-- rename it here and pass the same name to Locker::table().
CREATE TABLE IF NOT EXISTS "dblock_locks" (
    lock_key      TEXT COLLATE "C" NOT NULL PRIMARY KEY
                  CHECK (octet_length(lock_key) BETWEEN 1 AND 255),
    owner         TEXT,
    hold_count    INTEGER     NOT NULL DEFAULT 0 CHECK (hold_count >= 0),
    fencing_token BIGINT      NOT NULL,
    expires_at    TIMESTAMPTZ NOT NULL,
    acquired_at   TIMESTAMPTZ NOT NULL,
    holder        TEXT,
    attempt_id    BIGINT,
    contended     BOOLEAN     NOT NULL DEFAULT false
) WITH (fillfactor = 80);
