-- dblock 0005 for MySQL/MariaDB, after 0004: the semaphores' permits (Locker::semaphore, `permits = N`).
-- A lock table of its own beside the lock table, its name the lock table's with `_permits`
-- appended: one row per permit slot, keyed `<key> 0x1F <permits>.<slot>`, each an ordinary lock
-- (0001 to 0004 again, under the new names). The same DDL Locker::migrate() runs.
CREATE TABLE IF NOT EXISTS `dblock_locks_permits` (
    lock_key      VARBINARY(255) NOT NULL,
    owner         VARCHAR(36) CHARACTER SET ascii COLLATE ascii_bin NULL,
    hold_count    INT         NOT NULL DEFAULT 0,
    fencing_token BIGINT      NOT NULL,
    expires_at    DATETIME(6) NOT NULL,
    acquired_at   DATETIME(6) NOT NULL,
    holder        VARCHAR(255) CHARACTER SET utf8mb4 NULL,
    attempt_id    BIGINT      NULL,
    PRIMARY KEY (lock_key)
) ENGINE = InnoDB;
ALTER TABLE `dblock_locks_permits`
    ADD COLUMN last_outcome TINYINT     NULL,
    ADD COLUMN finished_at  DATETIME(6) NULL,
    ADD COLUMN available_at DATETIME(6) NULL;
ALTER TABLE `dblock_locks_permits`
    ADD COLUMN success_token BIGINT  NULL,
    ADD COLUMN once_key      BOOLEAN NOT NULL DEFAULT 0,
    ADD COLUMN release_id    BIGINT  NULL,
    ADD COLUMN release_token BIGINT  NULL;
CREATE TABLE IF NOT EXISTS `dblock_locks_permits_queue` (
    lock_key   VARBINARY(255) NOT NULL,
    ticket     BIGINT      NOT NULL AUTO_INCREMENT,
    owner      VARCHAR(36) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    expires_at DATETIME(6) NOT NULL,
    PRIMARY KEY (lock_key, ticket),
    KEY (ticket)
) ENGINE = InnoDB;
