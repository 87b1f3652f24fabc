-- A batched statement waits at most 100 ms for a row lock (docs/guarantees.md, "Batches
-- without shared fate"). A row that something else holds locked (an operator's open
-- transaction, a slow statement) held every key of a batched statement until the statement
-- timeout; now the statement fails with lock_not_available after 100 ms, nothing of it
-- written, and the gateway runs each of its keys alone (src/store/postgres/batch.rs), where
-- only the key on the held row waits, within its own statement timeout.
--
-- The setting goes with the function call (a function's SET clause holds for the call only:
-- a session setting would outlive the statement and, behind a pooler, reach other clients).
-- The batched completion is migration 7's function. The batched claim of new keys, a
-- statement sent as it is until now, becomes a function here; its body is the statement
-- verbatim (a unit test in src/store/postgres/statements.rs checks it). PL/pgSQL caches the
-- statement's plan per session, as a prepared statement's is.
--
-- Only a batch of two keys or more runs these; a key alone runs the single-key statements,
-- which wait for a lock as long as their statement timeout allows.

ALTER FUNCTION idemgate_finish_batch(
    text[], text[], text[], text[], integer[], bytea[], bytea[], bigint[], text[])
    SET lock_timeout = '100ms';

CREATE OR REPLACE FUNCTION idemgate_claim_new_batch(
    text[], text[], text[], bytea[], bigint[], bigint[])
RETURNS TABLE (o_scope text, o_key text, o_token text)
LANGUAGE plpgsql VOLATILE
SET lock_timeout = '100ms'
AS $fn$
BEGIN
RETURN QUERY
INSERT INTO idemgate_keys
    (scope, key, route, fingerprint, state, lease_token, lease_expires_at, attempts,
     created_at, expires_at, gc_after)
SELECT v.scope, v.key, v.route, v.fingerprint, 'in_flight', gen_random_uuid(),
       now() + v.lease_ms * interval '1 millisecond', 1,
       now(), now() + v.ttl_ms * interval '1 millisecond',
       now() + v.ttl_ms * interval '1 millisecond'
  FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::bigint[], $6::bigint[])
       AS v(scope, key, route, fingerprint, lease_ms, ttl_ms)
ON CONFLICT (scope, key) DO NOTHING
RETURNING scope, key, lease_token::text;
END
$fn$;
