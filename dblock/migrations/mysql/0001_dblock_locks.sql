-- dblock lock table for MySQL 8 / MariaDB >= 10.5: the same DDL Locker::migrate() runs.
-- For teams that apply migrations with their own tool. To use another table name,
-- rename it here and pass the same name to Locker::table().
CREATE TABLE IF NOT EXISTS `dblock_locks` (
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
