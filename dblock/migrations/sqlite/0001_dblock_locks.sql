-- dblock lock table for SQLite >= 3.35: the same DDL Locker::migrate() runs.
-- For teams that apply migrations with their own tool. To use another table name,
-- rename it here and pass the same name to Locker::table().
CREATE TABLE IF NOT EXISTS "dblock_locks" (
    lock_key      TEXT    NOT NULL PRIMARY KEY
                  CHECK (length(CAST(lock_key AS BLOB)) BETWEEN 1 AND 255),
    owner         TEXT,
    hold_count    INTEGER NOT NULL DEFAULT 0 CHECK (hold_count >= 0),
    fencing_token INTEGER NOT NULL,
    expires_at    INTEGER NOT NULL, -- ms since the Unix epoch
    acquired_at   INTEGER NOT NULL, -- ms since the Unix epoch
    holder        TEXT,
    attempt_id    INTEGER
) WITHOUT ROWID;
