-- dblock 0004 for SQLite, after 0003: the queue of fair waiters (LockRequest::fair,
-- `fair = true`), one row per waiting caller with its ticket in arrival order and a short lease.
-- Its name is the lock table's with `_queue` appended. The same DDL Locker::migrate() runs.
CREATE TABLE IF NOT EXISTS "dblock_locks_queue" (
    ticket     INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    lock_key   TEXT    NOT NULL,
    owner      TEXT    NOT NULL,
    expires_at INTEGER NOT NULL -- ms since the Unix epoch
);
