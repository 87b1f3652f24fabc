-- The two statements of a new key (src/store/postgres/statements.rs: the claim, CLAIM_NEW_SQL, and
-- the completion, FINISH_SQL) as PL/pgSQL functions, for a gateway behind a pooler in transaction
-- mode (store.postgres.pooler: transaction). There a named prepared statement cannot be used (the
-- next transaction may run on another server connection), so each statement sent would be parsed
-- and planned every time: about twice the database CPU per key of a prepared one. PL/pgSQL caches
-- each statement's plan per server session, and the pooler keeps those sessions, so a call is
-- parsed and planned once per session (benches/pooler_cost.sh measures the three; docs/scaling.md
-- has the numbers). A direct session keeps using the statements themselves, prepared.
--
-- The bodies are the statements verbatim (a unit test in src/store/postgres/statements.rs
-- checks it), so both paths write the same rows.

CREATE OR REPLACE FUNCTION idemgate_claim_new(text, text, text, bytea, bigint, bigint)
RETURNS text
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    v_token text;
BEGIN
INSERT INTO idemgate_keys
    (scope, key, route, fingerprint, state, lease_token, lease_expires_at, attempts,
     created_at, expires_at, gc_after)
VALUES ($1, $2, $3, $4, 'in_flight', gen_random_uuid(),
        now() + $5::bigint * interval '1 millisecond', 1,
        now(), now() + $6::bigint * interval '1 millisecond',
        now() + $6::bigint * interval '1 millisecond')
ON CONFLICT (scope, key) DO NOTHING
RETURNING lease_token::text
  INTO v_token;
    -- NULL: the key exists (ON CONFLICT DO NOTHING inserted nothing).
    RETURN v_token;
END
$fn$;

CREATE OR REPLACE FUNCTION idemgate_finish(text, text, text, text, integer, bytea, bytea, bigint, text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $fn$
DECLARE
    v_announced text;
BEGIN
UPDATE idemgate_keys
   SET state = CASE
           WHEN $4::text = 'completed'
                AND $5::integer IS NOT NULL AND $6::bytea IS NOT NULL AND $7::bytea IS NOT NULL
               THEN 'completed'
           WHEN $4::text IN ('not_replayable', 'unknown') THEN $4::text
       END,
       status = $5, headers = $6, body = $7,
       lease_token = NULL, lease_expires_at = NULL, completed_at = now(),
       expires_at = now() + $8::bigint * interval '1 millisecond'
 WHERE scope = $1 AND key = $2 AND lease_token = $3::text::uuid AND state = 'in_flight'
RETURNING CASE WHEN waiters THEN pg_notify('idemgate_keys', $9) END AS announced
  INTO v_announced;
    -- false: the lease was lost, nothing written (as no row back from the statement).
    RETURN FOUND;
END
$fn$;
