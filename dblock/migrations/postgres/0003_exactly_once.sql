-- dblock 0003 for PostgreSQL, after 0002: a success committed in the caller's transaction
-- (success_token: the tenure whose success committed with the work, `succeed_in`), keys taken
-- with `once` (once_key: `purge` keeps their success), and the last release (release_id,
-- release_token), which no acquire overwrites. The same DDL Locker::migrate() runs.
ALTER TABLE "dblock_locks"
    ADD COLUMN IF NOT EXISTS success_token BIGINT,
    ADD COLUMN IF NOT EXISTS once_key      BOOLEAN NOT NULL DEFAULT false,
    ADD COLUMN IF NOT EXISTS release_id    BIGINT,
    ADD COLUMN IF NOT EXISTS release_token BIGINT;
