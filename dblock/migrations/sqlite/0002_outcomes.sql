-- dblock 0002 for SQLite, after 0001: how each hold ended (last_outcome: 1 succeeded, 2 failed,
-- 3 dropped; finished_at) and min_hold (available_at), times in ms since the Unix epoch. The same DDL
-- Locker::migrate() runs (once: SQLite has no ADD COLUMN IF NOT EXISTS).
ALTER TABLE "dblock_locks" ADD COLUMN last_outcome INTEGER;
ALTER TABLE "dblock_locks" ADD COLUMN finished_at INTEGER;
ALTER TABLE "dblock_locks" ADD COLUMN available_at INTEGER;
