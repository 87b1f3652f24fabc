-- The keys table as lean per new key as a bare claim + completion pair.
--
-- 1. No CHECK constraints. PostgreSQL rebuilds every CHECK from its stored expression text at the
--    start of each statement that writes the table (a parse per statement, the top of its profile
--    per new key). What they guarded is guarded by the statements that write those columns
--    (src/store/postgres/statements.rs): the claim writes 'in_flight' with a generated lease token
--    and a lease expiry; the completion can only write 'completed' with status, headers and body,
--    or 'not_replayable' or 'unknown', and fails (state NULL) on anything else. A test checks every
--    row after the gateway's flows (tests/it/row_invariants.rs).
--
-- 2. Garbage collection no longer indexes expires_at, which every completion rewrites: an
--    UPDATE that changes an indexed column can never be HOT (it adds an entry to every index
--    and usually a new page). It indexes gc_after instead, written only by a claim (claim time
--    + ttl). A completion sets expires_at to its own now() + the same ttl, and it runs after
--    its claim, so gc_after <= expires_at: every expired row has gc_after in the past, and the
--    collector, which still deletes only rows whose expires_at has passed, finds them all by
--    gc_after.
--
-- 3. fillfactor 90: inserts leave a tenth of each page free, so that a completion's new row
--    version fits on the page of its claim (a HOT update needs the same page).
--
-- Online: every statement here changes the catalog only and holds its lock for moments (the
-- migration runner bounds each lock wait, src/store/postgres/migrate.rs). gc_after is added with
-- the constant default '-infinity' (kept in the catalog, no rewrite): existing rows, and rows
-- that an instance of an earlier release inserts during a rolling upgrade, are at once
-- eligible for the collector, which deletes them when their expires_at passes. What would
-- scan or rewrite the table runs after this transaction, without blocking writes: the
-- gc_after index is built concurrently, and a backfill sets gc_after = expires_at on the
-- rows at the default, in small batches (the collector repeats it for later ones). On a
-- table with no rows yet the index is made here (below).
-- A table partitioned by scope as in docs/operations.md is handled too: its expires_at index
-- is found by column, and fillfactor is set on its partitions.

ALTER TABLE idemgate_keys
    DROP CONSTRAINT IF EXISTS idemgate_keys_state_check,
    DROP CONSTRAINT IF EXISTS idemgate_keys_check,
    DROP CONSTRAINT IF EXISTS idemgate_keys_check1,
    ADD COLUMN gc_after timestamptz NOT NULL DEFAULT '-infinity';

DO $$
DECLARE
    r record;
BEGIN
    -- Every index whose only column is expires_at (named idemgate_keys_expires_at here, or
    -- idemgate_keys_expires_at_idx on a table partitioned as in docs/operations.md).
    FOR r IN
        SELECT i.indexrelid::regclass AS idx
          FROM pg_index i
          JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
         WHERE i.indrelid = 'idemgate_keys'::regclass
           AND i.indnatts = 1
           AND a.attname = 'expires_at'
    LOOP
        EXECUTE format('DROP INDEX %s', r.idx);
    END LOOP;
    -- The table itself, or each partition of a partitioned one (a partitioned table has no
    -- storage parameters of its own). Takes a lock that does not block writes, and applies
    -- to pages written from now on.
    FOR r IN
        SELECT c.oid::regclass AS tbl
          FROM pg_class c
         WHERE c.oid = 'idemgate_keys'::regclass AND c.relkind = 'r'
        UNION ALL
        SELECT t.relid
          FROM pg_partition_tree('idemgate_keys') t
          JOIN pg_class c ON c.oid = t.relid
         WHERE t.isleaf AND c.relkind = 'r'
    LOOP
        EXECUTE format('ALTER TABLE %s SET (fillfactor = 90)', r.tbl);
    END LOOP;
END
$$;

-- A table with no rows yet (a new install) gets its gc_after index here, at once: there is
-- nothing to scan. A table with rows gets it built concurrently after this transaction.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM idemgate_keys) THEN
        CREATE INDEX idemgate_keys_gc_after ON idemgate_keys (gc_after);
    END IF;
END
$$;
