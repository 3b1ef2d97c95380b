-- dblock 0006 for SQLite, after 0005: shared (read) locks (Locker::read, `shared = true`):
-- the ids of the readers that hold a key together (readers), and a waiting writer's intent
-- (intent_until, intent_token, intent_owner) that makes later readers wait behind it. Applied to
-- the permits table too, as Locker::migrate() keeps it in step. The same DDL Locker::migrate() runs.
ALTER TABLE "dblock_locks_permits" ADD COLUMN readers TEXT;
ALTER TABLE "dblock_locks_permits" ADD COLUMN intent_until INTEGER;
ALTER TABLE "dblock_locks_permits" ADD COLUMN intent_token INTEGER;
ALTER TABLE "dblock_locks_permits" ADD COLUMN intent_owner TEXT;
ALTER TABLE "dblock_locks" ADD COLUMN readers TEXT;
ALTER TABLE "dblock_locks" ADD COLUMN intent_until INTEGER;
ALTER TABLE "dblock_locks" ADD COLUMN intent_token INTEGER;
ALTER TABLE "dblock_locks" ADD COLUMN intent_owner TEXT;
