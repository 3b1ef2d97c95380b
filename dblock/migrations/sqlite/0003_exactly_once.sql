-- dblock 0003 for SQLite, after 0002: a success committed in the caller's transaction
-- (success_token: the tenure whose success committed with the work, `succeed_in`), keys taken
-- with `once` (once_key: `purge` keeps their success), and the last release (release_id,
-- release_token), which no acquire overwrites. The same DDL Locker::migrate() runs (once: SQLite
-- has no ADD COLUMN IF NOT EXISTS).
ALTER TABLE "dblock_locks" ADD COLUMN success_token INTEGER;
ALTER TABLE "dblock_locks" ADD COLUMN once_key INTEGER NOT NULL DEFAULT 0;
ALTER TABLE "dblock_locks" ADD COLUMN release_id INTEGER;
ALTER TABLE "dblock_locks" ADD COLUMN release_token INTEGER;
