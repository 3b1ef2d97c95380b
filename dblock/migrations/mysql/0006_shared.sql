-- dblock 0006 for MySQL/MariaDB, after 0005: shared (read) locks (Locker::read, `shared = true`):
-- the ids of the readers that hold a key together (readers), and a waiting writer's intent
-- (intent_until, intent_token, intent_owner) that makes later readers wait behind it. Applied to
-- the permits table too, as Locker::migrate() keeps it in step. The same DDL Locker::migrate() runs.
ALTER TABLE `dblock_locks_permits`
    ADD COLUMN readers      TEXT CHARACTER SET ascii NULL,
    ADD COLUMN intent_until DATETIME(6) NULL,
    ADD COLUMN intent_token BIGINT      NULL,
    ADD COLUMN intent_owner VARCHAR(36) CHARACTER SET ascii COLLATE ascii_bin NULL;
ALTER TABLE `dblock_locks`
    ADD COLUMN readers      TEXT CHARACTER SET ascii NULL,
    ADD COLUMN intent_until DATETIME(6) NULL,
    ADD COLUMN intent_token BIGINT      NULL,
    ADD COLUMN intent_owner VARCHAR(36) CHARACTER SET ascii COLLATE ascii_bin NULL;
