-- `serialize.max_in_flight` holds per route, also when routes with different limits share a
-- scope: every slot row carries the limit of the route that holds it, and a request of a
-- route with limit L takes a slot only if, counting itself, the scope's live slots number at
-- most L and at most the limit of every live holder.
--
-- NULL: a slot taken by a gateway that predates this column; it counts as a holder and sets
-- no limit of its own.
ALTER TABLE idemgate_slots ADD COLUMN max_in_flight integer;

-- Takes a slot of p_scope for a route with limit p_limit, leased for p_lease_ms; no row back
-- when the rule says wait. The decision is made under a per-scope transaction lock taken
-- before any row is read: under READ COMMITTED one statement's snapshot cannot see a
-- concurrent taker of another slot number, so without the lock two takers could each count
-- the other out. Each statement of a volatile plpgsql function takes a new snapshot, so the
-- count sees every slot committed before the lock was granted (a taker commits before it
-- lets go of the lock). A release needs no lock: a taker that misses it only waits longer.
-- The lock lives as long as the caller's transaction: call this as one statement of its own
-- (autocommit), never inside a longer transaction.
CREATE FUNCTION idemgate_take_slot(p_scope text, p_limit integer, p_lease_ms bigint)
RETURNS TABLE (slot integer, token text)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_live  integer;
    v_least integer;
    v_slot  integer;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('idemgate_slots:' || p_scope, 0));
    SELECT count(*), min(s.max_in_flight) INTO v_live, v_least
      FROM idemgate_slots s
     WHERE s.scope = p_scope AND s.lease_expires_at > now();
    IF v_live + 1 > p_limit OR v_live + 1 > coalesce(v_least, p_limit) THEN
        RETURN;
    END IF;
    -- The lowest number no live slot holds (one of 0..v_live is free); an expired row there
    -- is taken over.
    SELECT g INTO v_slot
      FROM generate_series(0, v_live) g
     WHERE NOT EXISTS (SELECT 1 FROM idemgate_slots s
                        WHERE s.scope = p_scope AND s.slot = g AND s.lease_expires_at > now())
     ORDER BY g LIMIT 1;
    RETURN QUERY
    INSERT INTO idemgate_slots AS s (scope, slot, token, lease_expires_at, max_in_flight)
    VALUES (p_scope, v_slot, gen_random_uuid(),
            now() + p_lease_ms * interval '1 millisecond', p_limit)
    ON CONFLICT ON CONSTRAINT idemgate_slots_pkey DO UPDATE
       SET token = EXCLUDED.token,
           lease_expires_at = EXCLUDED.lease_expires_at,
           max_in_flight = EXCLUDED.max_in_flight
     WHERE s.lease_expires_at <= now()
    RETURNING s.slot, s.token::text;
END;
$$;
