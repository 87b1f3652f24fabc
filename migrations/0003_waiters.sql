-- Set while some gateway waits for this in-flight row, so that finishing it announces
-- (NOTIFY) only when someone listens for it: a NOTIFY serializes commits cluster-wide, and
-- most keys are never waited for. Reset by every new claim.
ALTER TABLE idemgate_keys ADD COLUMN waiters boolean NOT NULL DEFAULT false;
