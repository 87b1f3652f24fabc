-- Per-scope forwarding slots for `serialize`: at most max_in_flight rows of a scope hold a
-- live lease at once. A row is one slot; a crashed holder's slot frees itself when its lease
-- ends. No transaction or session lock is held across the upstream call.
CREATE TABLE idemgate_slots (
    scope            text        NOT NULL,
    slot             integer     NOT NULL,
    token            uuid        NOT NULL,
    lease_expires_at timestamptz NOT NULL,
    PRIMARY KEY (scope, slot)
);
