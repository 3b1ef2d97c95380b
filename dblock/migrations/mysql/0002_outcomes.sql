-- dblock 0002 for MySQL 8 / MariaDB, after 0001: how each hold ended (last_outcome: 1
-- succeeded, 2 failed, 3 dropped; finished_at) and min_hold (available_at). The same DDL Locker::migrate()
-- runs (once: MySQL 8 has no ADD COLUMN IF NOT EXISTS).
ALTER TABLE `dblock_locks`
    ADD COLUMN last_outcome TINYINT     NULL,
    ADD COLUMN finished_at  DATETIME(6) NULL,
    ADD COLUMN available_at DATETIME(6) NULL;
