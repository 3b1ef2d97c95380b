-- dblock 0005 for SQLite, after 0004: the semaphores' permits (Locker::semaphore, `permits = N`).
-- A lock table of its own beside the lock table, its name the lock table's with `_permits`
-- appended: one row per permit slot, keyed `<key> 0x1F <permits>.<slot>`, each an ordinary lock
-- (0001 to 0004 again, under the new names). The same DDL Locker::migrate() runs.
CREATE TABLE IF NOT EXISTS "dblock_locks_permits" (
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
ALTER TABLE "dblock_locks_permits" ADD COLUMN last_outcome INTEGER;
ALTER TABLE "dblock_locks_permits" ADD COLUMN finished_at INTEGER;
ALTER TABLE "dblock_locks_permits" ADD COLUMN available_at INTEGER;
ALTER TABLE "dblock_locks_permits" ADD COLUMN success_token INTEGER;
ALTER TABLE "dblock_locks_permits" ADD COLUMN once_key INTEGER NOT NULL DEFAULT 0;
ALTER TABLE "dblock_locks_permits" ADD COLUMN release_id INTEGER;
ALTER TABLE "dblock_locks_permits" ADD COLUMN release_token INTEGER;
CREATE TABLE IF NOT EXISTS "dblock_locks_permits_queue" (
    ticket     INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    lock_key   TEXT    NOT NULL,
    owner      TEXT    NOT NULL,
    expires_at INTEGER NOT NULL -- ms since the Unix epoch
);
