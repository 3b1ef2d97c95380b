-- dblock 0006 for PostgreSQL, after 0005: shared (read) locks (Locker::read, `shared = true`):
-- the ids of the readers that hold a key together (readers), and a waiting writer's intent
-- (intent_until, intent_token, intent_owner) that makes later readers wait behind it. Applied to
-- the permits table too, as Locker::migrate() keeps it in step. The same DDL Locker::migrate() runs.
ALTER TABLE "dblock_locks_permits"
    ADD COLUMN IF NOT EXISTS readers      TEXT,
    ADD COLUMN IF NOT EXISTS intent_until TIMESTAMPTZ,
    ADD COLUMN IF NOT EXISTS intent_token BIGINT,
    ADD COLUMN IF NOT EXISTS intent_owner TEXT;
ALTER TABLE "dblock_locks"
    ADD COLUMN IF NOT EXISTS readers      TEXT,
    ADD COLUMN IF NOT EXISTS intent_until TIMESTAMPTZ,
    ADD COLUMN IF NOT EXISTS intent_token BIGINT,
    ADD COLUMN IF NOT EXISTS intent_owner TEXT;
