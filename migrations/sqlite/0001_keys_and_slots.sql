-- The embedded store's schema: the same rows as the Postgres store (migrations/0001_keys.sql
-- and 0002_slots.sql), in SQLite's types. Times are milliseconds since the epoch, read from
-- the database clock.
CREATE TABLE idemgate_keys (
    scope            TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    route            TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL,
    state            TEXT    NOT NULL
        CHECK (state IN ('in_flight', 'completed', 'not_replayable', 'unknown')),
    lease_token      TEXT,
    lease_expires_at INTEGER,
    attempts         INTEGER NOT NULL DEFAULT 1,
    status           INTEGER,
    headers          BLOB,
    body             BLOB,
    created_at       INTEGER NOT NULL,
    completed_at     INTEGER,
    expires_at       INTEGER NOT NULL,
    PRIMARY KEY (scope, key),
    CHECK (state <> 'in_flight' OR (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CHECK (state <> 'completed' OR (status IS NOT NULL AND body IS NOT NULL AND headers IS NOT NULL))
) WITHOUT ROWID;

CREATE INDEX idemgate_keys_expires_at ON idemgate_keys (expires_at);

CREATE TABLE idemgate_slots (
    scope            TEXT    NOT NULL,
    slot             INTEGER NOT NULL,
    token            TEXT    NOT NULL,
    lease_expires_at INTEGER NOT NULL,
    PRIMARY KEY (scope, slot)
) WITHOUT ROWID;
