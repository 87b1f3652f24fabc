-- The claim table: one row per (scope, key).
--
-- state:
--   in_flight       claimed; lease_token and lease_expires_at fence every later write
--   completed       status, headers and body hold the stored response
--   not_replayable  the response was too large to store; retries get 502
--   unknown         the outcome is unknown and the route holds such keys
--
-- Every statement filters on the full key (scope, key), so the table can be
-- hash-partitioned or distributed by scope without code changes.
CREATE TABLE idemgate_keys (
    scope            text        NOT NULL,
    key              text        NOT NULL,
    route            text        NOT NULL,
    fingerprint      bytea       NOT NULL,
    state            text        NOT NULL
        CHECK (state IN ('in_flight', 'completed', 'not_replayable', 'unknown')),
    lease_token      uuid,
    lease_expires_at timestamptz,
    attempts         integer     NOT NULL DEFAULT 1,
    status           integer,
    headers          bytea,
    body             bytea,
    created_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    expires_at       timestamptz NOT NULL,
    PRIMARY KEY (scope, key),
    CHECK (state <> 'in_flight' OR (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CHECK (state <> 'completed' OR (status IS NOT NULL AND body IS NOT NULL AND headers IS NOT NULL))
);

-- For garbage collection of expired rows.
CREATE INDEX idemgate_keys_expires_at ON idemgate_keys (expires_at);
