-- The completion of several keys in one statement and one commit (a batch, see
-- src/store/postgres/batch.rs), as one PL/pgSQL function that writes each key with the
-- single-key completion (idemgate_finish, migration 6): the same fenced write, in the order
-- the gateway sorted the keys (so concurrent batches lock rows in one order), each row found
-- by its primary key.
--
-- Before this, the batch was one UPDATE ... FROM unnest(...) sent unnamed: parsed and planned
-- at every call, since a plan cached while the table was small joined it by scanning it whole
-- once it had grown. The function is called as a prepared statement and its inner statement's
-- plan is cached per session, and a lookup by primary key is the best plan at any table size.
--
-- Returns the 1-based position of each key it wrote (a key whose lease was lost is left out).

CREATE OR REPLACE FUNCTION idemgate_finish_batch(
    text[], text[], text[], text[], integer[], bytea[], bytea[], bigint[], text[])
RETURNS SETOF integer
LANGUAGE plpgsql VOLATILE
AS $fn$
BEGIN
    FOR i IN 1 .. coalesce(array_length($1, 1), 0) LOOP
        IF idemgate_finish($1[i], $2[i], $3[i], $4[i], $5[i], $6[i], $7[i], $8[i], $9[i]) THEN
            RETURN NEXT i;
        END IF;
    END LOOP;
END
$fn$;
