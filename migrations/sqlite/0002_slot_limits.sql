-- The embedded store's side of migrations/0005_slot_limits.sql (numbered after it): every
-- slot row carries the limit of the route that holds it, so that a request of a route with
-- limit L takes a slot only if, counting itself, the scope's live slots number at most L and
-- at most the limit of every live holder. NULL: a slot taken before this column existed; it
-- counts as a holder and sets no limit of its own.
ALTER TABLE idemgate_slots ADD COLUMN max_in_flight INTEGER;
