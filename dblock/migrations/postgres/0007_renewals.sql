-- dblock 0007 for PostgreSQL, after 0006: how many times a hold's lease was renewed, for the
-- admin view (Locker::inspect, Locker::held, `dblock list`): `renewals` counts the extensions of
-- the tenure whose fencing token is `renewals_token` (a new tenure has a new token, so its count
-- starts again without the acquire statements writing it). Applied to the permits table too, as
-- Locker::migrate() keeps it in step. The same DDL Locker::migrate() runs.
ALTER TABLE "dblock_locks_permits"
    ADD COLUMN IF NOT EXISTS renewals       INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS renewals_token BIGINT;
ALTER TABLE "dblock_locks"
    ADD COLUMN IF NOT EXISTS renewals       INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS renewals_token BIGINT;
