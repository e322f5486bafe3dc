-- dedupgate PostgreSQL schema, version 2: the ttl a claim asked for.
--
-- * ttl_ms (in_progress rows only): a complete that names no ttl keeps the record until
--   created_at_ms + ttl_ms, not until the lease end that may have held the claim's expiry later.
--   NULL on rows claimed before this version (and on every other row): their expiry stands.
-- * Adding a nullable column without a default rewrites no row.

ALTER TABLE {s}.dedupgate_records ADD COLUMN ttl_ms bigint;
