-- dedupgate PostgreSQL schema, version 1: the data-bearing objects (table, index, answer type).
--
-- `{s}` is replaced by the quoted schema name before this runs, so every object is named with its
-- schema and nothing depends on a session's search_path.
--
-- The functions that operate on these objects are in ../functions.sql: they hold no data, so
-- they are re-created whenever their text changes (see schema.rs), while this file runs once.
--
-- * An entry is live while now_ms < expires_at_ms and state <> released (2). A dead entry is
--   absent for every answer, but its fence still counts for the next claim.
-- * state: 0 in_progress, 1 completed, 2 released (a fence-keeping tombstone).
-- * Strings a client chose (namespace, key, fingerprint, owner, token) are bytea, so any UTF-8
--   (NUL included, which text refuses) is stored exactly. Results are the JSON text as bytea:
--   jsonb would reorder keys and normalise numbers, and text would depend on the database encoding.

CREATE TABLE {s}.dedupgate_records (
    namespace           bytea    NOT NULL,
    key                 bytea    NOT NULL,
    state               smallint NOT NULL CHECK (state IN (0, 1, 2)),
    fence               bigint   NOT NULL CHECK (fence > 0),
    token               bytea,
    fingerprint         bytea,
    owner               bytea,
    created_at_ms       bigint   NOT NULL,
    expires_at_ms       bigint   NOT NULL,
    lease_expires_at_ms bigint,
    completed_at_ms     bigint,
    result              bytea,
    PRIMARY KEY (namespace, key)
);

-- The sweeper finds expired rows through this index, so a sweep costs its batch, not the table.
CREATE INDEX dedupgate_records_expires_at_ms ON {s}.dedupgate_records (expires_at_ms);

CREATE TYPE {s}.dedupgate_answer AS (
    code                smallint,
    state               smallint,
    fence               bigint,
    token               bytea,
    fingerprint         bytea,
    owner               bytea,
    created_at_ms       bigint,
    expires_at_ms       bigint,
    lease_expires_at_ms bigint,
    completed_at_ms     bigint,
    result              bytea
);
