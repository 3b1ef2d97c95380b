-- dblock 0002 for PostgreSQL, after 0001: how each hold ended (last_outcome: 1 succeeded,
-- 2 failed, 3 dropped; finished_at) and min_hold (available_at). The same DDL Locker::migrate() runs.
ALTER TABLE "dblock_locks"
    ADD COLUMN IF NOT EXISTS last_outcome SMALLINT,
    ADD COLUMN IF NOT EXISTS finished_at  TIMESTAMPTZ,
    ADD COLUMN IF NOT EXISTS available_at TIMESTAMPTZ;
