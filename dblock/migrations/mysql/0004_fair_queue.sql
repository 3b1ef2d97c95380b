-- dblock 0004 for MySQL 8 / MariaDB, after 0003: the queue of fair waiters (LockRequest::fair,
-- `fair = true`), one row per waiting caller with its ticket in arrival order and a short lease.
-- Its name is the lock table's with `_queue` appended. The same DDL Locker::migrate() runs.
CREATE TABLE IF NOT EXISTS `dblock_locks_queue` (
    lock_key   VARBINARY(255) NOT NULL,
    ticket     BIGINT      NOT NULL AUTO_INCREMENT,
    owner      VARCHAR(36) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    expires_at DATETIME(6) NOT NULL,
    PRIMARY KEY (lock_key, ticket),
    KEY (ticket)
) ENGINE = InnoDB;
