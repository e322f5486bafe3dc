-- dedupgate PostgreSQL schema, version 1.
--
-- `{s}` is replaced by the quoted schema name before this runs, so every object is named with its
-- schema and nothing depends on a session's search_path.
--
-- Every operation is one call of one function below. Each function re-expresses
-- dedupgate_core::decide (crates/dedupgate-core/src/decide.rs) for one operation; the
-- conformance suite keeps them equal. Conventions shared by all of them:
--
-- * Time: `{s}.dedupgate_now_ms()` = clock_timestamp() in unix milliseconds, read ONCE per
--   operation at its start. Not now(): now() is frozen at the start of the transaction, so inside
--   a caller's long transaction (the transactional API) or a batch a lease would start in the past.
-- * An entry is live while now_ms < expires_at_ms and state <> released (2). A dead entry is
--   absent for every answer, but its fence still counts for the next claim.
-- * state: 0 in_progress, 1 completed, 2 released (a fence-keeping tombstone).
-- * Answer codes: 1 ok (new / completed / released / extended / found / forgotten),
--   2 duplicate, 3 fingerprint mismatch, 4 lease lost, 5 absent (get, forget).
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

CREATE FUNCTION {s}.dedupgate_now_ms() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint
$$;

-- Answers are built inline as ROW(code, <entry columns>)::dedupgate_answer, never through a
-- helper SQL function: PostgreSQL does not inline SQL functions that return a composite, and
-- calling one per operation doubled the CPU cost of a claim.

-- Claim: one INSERT ... ON CONFLICT DO UPDATE ... WHERE that creates the entry, takes over a dead
-- or lease-expired one, or renews the same owner's claim. When the WHERE refuses (a live entry
-- held by someone else, completed, or with another fingerprint) ON CONFLICT still locks the row,
-- so the SELECT after it reads exactly the version the WHERE judged, and nobody can change it
-- before this transaction ends.
CREATE FUNCTION {s}.dedupgate_claim(p_ns bytea, p_key bytea, p_ttl_ms bigint, p_lease_ms bigint,
                                    p_fp bytea, p_owner bytea, p_token bytea)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now   bigint := {s}.dedupgate_now_ms();
    v_lease bigint := v_now + p_lease_ms;
    r       {s}.dedupgate_records;
BEGIN
    -- Duplicates first, from a plain MVCC read without a lock: an entry that is live and that
    -- this claim may neither take over nor renew is answered as it was committed, and the
    -- answer writes nothing (no row lock, so no WAL and no commit flush for a duplicate).
    SELECT * INTO r FROM {s}.dedupgate_records WHERE namespace = p_ns AND key = p_key;
    IF FOUND AND r.expires_at_ms > v_now AND r.state <> 2 THEN
        IF r.fingerprint IS NOT NULL AND p_fp IS NOT NULL AND r.fingerprint <> p_fp THEN
            RETURN ROW(3::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                       NULL)::{s}.dedupgate_answer;
        END IF;
        IF NOT (r.state = 0 AND (coalesce(r.owner = p_owner, false)
                                 OR coalesce(r.lease_expires_at_ms <= v_now, false))) THEN
            RETURN ROW(2::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
                       r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                       r.completed_at_ms, r.result)::{s}.dedupgate_answer;
        END IF;
    END IF;
    -- The write: judged again under the row lock, as the entry may have changed since the read.
    INSERT INTO {s}.dedupgate_records AS e
        (namespace, key, state, fence, token, fingerprint, owner, created_at_ms, expires_at_ms,
         lease_expires_at_ms, completed_at_ms, result)
    VALUES (p_ns, p_key, 0, v_now * 1000, p_token, p_fp, p_owner, v_now,
            greatest(v_now + p_ttl_ms, v_lease), v_lease, NULL, NULL)
    ON CONFLICT (namespace, key) DO UPDATE SET
        -- renew: a live in_progress entry of the same non-null owner keeps token and fence.
        fence = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = p_owner
                     THEN e.fence ELSE greatest(e.fence + 1, v_now * 1000) END,
        token = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = p_owner
                     THEN e.token ELSE p_token END,
        fingerprint = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = p_owner
                     THEN e.fingerprint ELSE p_fp END,
        owner = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = p_owner
                     THEN e.owner ELSE p_owner END,
        created_at_ms = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = p_owner
                     THEN e.created_at_ms ELSE v_now END,
        expires_at_ms = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = p_owner
                     THEN greatest(e.expires_at_ms, v_lease)
                     ELSE greatest(v_now + p_ttl_ms, v_lease) END,
        state = 0,
        lease_expires_at_ms = v_lease,
        completed_at_ms = NULL,
        result = NULL
    WHERE NOT (e.expires_at_ms > v_now AND e.state <> 2)
       OR (NOT (e.fingerprint IS NOT NULL AND p_fp IS NOT NULL AND e.fingerprint <> p_fp)
           AND e.state = 0
           AND (coalesce(e.owner = p_owner, false) OR coalesce(e.lease_expires_at_ms <= v_now, false)))
    RETURNING e.* INTO r;
    IF FOUND THEN
        RETURN ROW(1::smallint, r.state, r.fence, r.token, r.fingerprint, r.owner,
                   r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                   r.completed_at_ms, r.result)::{s}.dedupgate_answer;
    END IF;
    SELECT * INTO r FROM {s}.dedupgate_records WHERE namespace = p_ns AND key = p_key;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'dedupgate: a claim conflicted with an entry it cannot read';
    END IF;
    IF r.fingerprint IS NOT NULL AND p_fp IS NOT NULL AND r.fingerprint <> p_fp THEN
        RETURN ROW(3::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
    END IF;
    RETURN ROW(2::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
                   r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                   r.completed_at_ms, r.result)::{s}.dedupgate_answer;
END
$$;

-- Mark: like claim, but the entry it makes is completed at once and it never renews.
CREATE FUNCTION {s}.dedupgate_mark(p_ns bytea, p_key bytea, p_ttl_ms bigint, p_fp bytea,
                                   p_result bytea)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint := {s}.dedupgate_now_ms();
    r     {s}.dedupgate_records;
BEGIN
    -- Duplicates from a plain read without a lock, as in dedupgate_claim.
    SELECT * INTO r FROM {s}.dedupgate_records WHERE namespace = p_ns AND key = p_key;
    IF FOUND AND r.expires_at_ms > v_now AND r.state <> 2 THEN
        IF r.fingerprint IS NOT NULL AND p_fp IS NOT NULL AND r.fingerprint <> p_fp THEN
            RETURN ROW(3::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                       NULL)::{s}.dedupgate_answer;
        END IF;
        IF NOT (r.state = 0 AND coalesce(r.lease_expires_at_ms <= v_now, false)) THEN
            RETURN ROW(2::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
                       r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                       r.completed_at_ms, r.result)::{s}.dedupgate_answer;
        END IF;
    END IF;
    INSERT INTO {s}.dedupgate_records AS e
        (namespace, key, state, fence, token, fingerprint, owner, created_at_ms, expires_at_ms,
         lease_expires_at_ms, completed_at_ms, result)
    VALUES (p_ns, p_key, 1, v_now * 1000, NULL, p_fp, NULL, v_now, v_now + p_ttl_ms, NULL, v_now,
            p_result)
    ON CONFLICT (namespace, key) DO UPDATE SET
        state = 1,
        fence = greatest(e.fence + 1, v_now * 1000),
        token = NULL,
        fingerprint = p_fp,
        owner = NULL,
        created_at_ms = v_now,
        expires_at_ms = v_now + p_ttl_ms,
        lease_expires_at_ms = NULL,
        completed_at_ms = v_now,
        result = p_result
    WHERE NOT (e.expires_at_ms > v_now AND e.state <> 2)
       OR (NOT (e.fingerprint IS NOT NULL AND p_fp IS NOT NULL AND e.fingerprint <> p_fp)
           AND e.state = 0
           AND coalesce(e.lease_expires_at_ms <= v_now, false))
    RETURNING e.* INTO r;
    IF FOUND THEN
        RETURN ROW(1::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
                   r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                   r.completed_at_ms, r.result)::{s}.dedupgate_answer;
    END IF;
    SELECT * INTO r FROM {s}.dedupgate_records WHERE namespace = p_ns AND key = p_key;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'dedupgate: a mark conflicted with an entry it cannot read';
    END IF;
    IF r.fingerprint IS NOT NULL AND p_fp IS NOT NULL AND r.fingerprint <> p_fp THEN
        RETURN ROW(3::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
    END IF;
    RETURN ROW(2::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
                   r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                   r.completed_at_ms, r.result)::{s}.dedupgate_answer;
END
$$;

-- Complete: only the current token of a live entry. A retried complete (entry already completed
-- with this token) is answered with the stored record and changes nothing.
CREATE FUNCTION {s}.dedupgate_complete(p_ns bytea, p_key bytea, p_token bytea, p_result bytea,
                                       p_ttl_ms bigint)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint := {s}.dedupgate_now_ms();
    r     {s}.dedupgate_records;
BEGIN
    SELECT * INTO r FROM {s}.dedupgate_records
        WHERE namespace = p_ns AND key = p_key FOR UPDATE;
    IF NOT FOUND OR r.expires_at_ms <= v_now OR r.state = 2
       OR r.token IS NULL OR r.token <> p_token THEN
        RETURN ROW(4::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
    END IF;
    IF r.state = 0 THEN
        UPDATE {s}.dedupgate_records SET
            state = 1,
            lease_expires_at_ms = NULL,
            completed_at_ms = v_now,
            result = p_result,
            expires_at_ms = CASE WHEN p_ttl_ms IS NULL THEN expires_at_ms ELSE v_now + p_ttl_ms END
        WHERE namespace = p_ns AND key = p_key
        RETURNING * INTO r;
    END IF;
    RETURN ROW(1::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
                   r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                   r.completed_at_ms, r.result)::{s}.dedupgate_answer;
END
$$;

-- Release: the holder gives the key back; the entry becomes a tombstone that keeps fence and
-- token, so a retried release is answered and the next claim's fence is higher.
CREATE FUNCTION {s}.dedupgate_release(p_ns bytea, p_key bytea, p_token bytea)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint := {s}.dedupgate_now_ms();
    r     {s}.dedupgate_records;
BEGIN
    SELECT * INTO r FROM {s}.dedupgate_records
        WHERE namespace = p_ns AND key = p_key FOR UPDATE;
    IF NOT FOUND OR r.expires_at_ms <= v_now OR r.token IS NULL OR r.token <> p_token
       OR r.state = 1 THEN
        RETURN ROW(4::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
    END IF;
    IF r.state = 0 THEN
        UPDATE {s}.dedupgate_records SET state = 2, lease_expires_at_ms = NULL, result = NULL
        WHERE namespace = p_ns AND key = p_key;
    END IF;
    RETURN ROW(1::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
END
$$;

-- Extend: renew the lease of the current holder; the record lives at least as long as the lease.
CREATE FUNCTION {s}.dedupgate_extend(p_ns bytea, p_key bytea, p_token bytea, p_lease_ms bigint)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now   bigint := {s}.dedupgate_now_ms();
    v_lease bigint := v_now + p_lease_ms;
    r       {s}.dedupgate_records;
BEGIN
    UPDATE {s}.dedupgate_records SET
        lease_expires_at_ms = v_lease,
        expires_at_ms = greatest(expires_at_ms, v_lease)
    WHERE namespace = p_ns AND key = p_key AND expires_at_ms > v_now AND state = 0
      AND token = p_token
    RETURNING * INTO r;
    IF FOUND THEN
        RETURN ROW(1::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
                   r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                   r.completed_at_ms, r.result)::{s}.dedupgate_answer;
    END IF;
    RETURN ROW(4::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
END
$$;

CREATE FUNCTION {s}.dedupgate_get(p_ns bytea, p_key bytea)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint := {s}.dedupgate_now_ms();
    r     {s}.dedupgate_records;
BEGIN
    SELECT * INTO r FROM {s}.dedupgate_records
        WHERE namespace = p_ns AND key = p_key AND expires_at_ms > v_now AND state <> 2;
    IF FOUND THEN
        RETURN ROW(1::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
                   r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                   r.completed_at_ms, r.result)::{s}.dedupgate_answer;
    END IF;
    RETURN ROW(5::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
END
$$;

-- Forget: a live entry becomes a tombstone without a token (the fence stays until its expiry).
CREATE FUNCTION {s}.dedupgate_forget(p_ns bytea, p_key bytea)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint := {s}.dedupgate_now_ms();
BEGIN
    UPDATE {s}.dedupgate_records SET
        state = 2, token = NULL, lease_expires_at_ms = NULL, result = NULL
    WHERE namespace = p_ns AND key = p_key AND expires_at_ms > v_now AND state <> 2;
    IF FOUND THEN
        RETURN ROW(1::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
    END IF;
    RETURN ROW(5::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
END
$$;

-- Many claims of distinct keys at one instant, set-based: one INSERT ... SELECT ... ON CONFLICT
-- DO UPDATE ... WHERE with exactly the per-row logic of dedupgate_claim (the proposed values are
-- EXCLUDED.*), rows locked in (namespace, key) order so concurrent batches cannot deadlock. As
-- the keys are distinct, no op can see another's effect, so this equals the ops one by one at a
-- single instant. The entries it could not take are locked by it and read by the next statement.
CREATE FUNCTION {s}.dedupgate_claim_answer(t {s}.dedupgate_records, r {s}.dedupgate_records,
                                           p_fp bytea)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF t.namespace IS NOT NULL THEN
        RETURN ROW(1::smallint, t.state, t.fence, t.token, t.fingerprint, t.owner,
                   t.created_at_ms, t.expires_at_ms, t.lease_expires_at_ms,
                   t.completed_at_ms, t.result)::{s}.dedupgate_answer;
    END IF;
    IF r.namespace IS NULL THEN
        RAISE EXCEPTION 'dedupgate: a claim conflicted with an entry it cannot read';
    END IF;
    IF r.fingerprint IS NOT NULL AND p_fp IS NOT NULL AND r.fingerprint <> p_fp THEN
        RETURN ROW(3::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
    END IF;
    RETURN ROW(2::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
                   r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                   r.completed_at_ms, r.result)::{s}.dedupgate_answer;
END
$$;

CREATE FUNCTION {s}.dedupgate_claim_distinct(p_ns bytea[], p_key bytea[], p_ttl_ms bigint[],
                                             p_lease_ms bigint[], p_fp bytea[], p_owner bytea[],
                                             p_token bytea[])
RETURNS SETOF {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now   bigint := {s}.dedupgate_now_ms();
    v_taken {s}.dedupgate_records[];
BEGIN
    WITH taken AS (
        INSERT INTO {s}.dedupgate_records AS e
            (namespace, key, state, fence, token, fingerprint, owner, created_at_ms, expires_at_ms,
             lease_expires_at_ms, completed_at_ms, result)
        SELECT u.ns, u.key, 0, v_now * 1000, u.token, u.fp, u.owner, v_now,
               greatest(v_now + u.ttl_ms, v_now + u.lease_ms), v_now + u.lease_ms, NULL, NULL
        FROM unnest(p_ns, p_key, p_ttl_ms, p_lease_ms, p_fp, p_owner, p_token)
             AS u(ns, key, ttl_ms, lease_ms, fp, owner, token)
        ORDER BY u.ns, u.key
        ON CONFLICT (namespace, key) DO UPDATE SET
            fence = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = EXCLUDED.owner
                         THEN e.fence ELSE greatest(e.fence + 1, v_now * 1000) END,
            token = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = EXCLUDED.owner
                         THEN e.token ELSE EXCLUDED.token END,
            fingerprint = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = EXCLUDED.owner
                         THEN e.fingerprint ELSE EXCLUDED.fingerprint END,
            owner = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = EXCLUDED.owner
                         THEN e.owner ELSE EXCLUDED.owner END,
            created_at_ms = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = EXCLUDED.owner
                         THEN e.created_at_ms ELSE v_now END,
            expires_at_ms = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = EXCLUDED.owner
                         THEN greatest(e.expires_at_ms, EXCLUDED.lease_expires_at_ms)
                         ELSE EXCLUDED.expires_at_ms END,
            state = 0,
            lease_expires_at_ms = EXCLUDED.lease_expires_at_ms,
            completed_at_ms = NULL,
            result = NULL
        WHERE NOT (e.expires_at_ms > v_now AND e.state <> 2)
           OR (NOT (e.fingerprint IS NOT NULL AND EXCLUDED.fingerprint IS NOT NULL
                    AND e.fingerprint <> EXCLUDED.fingerprint)
               AND e.state = 0
               AND (coalesce(e.owner = EXCLUDED.owner, false)
                    OR coalesce(e.lease_expires_at_ms <= v_now, false)))
        RETURNING e.*
    )
    SELECT array_agg(ROW(taken.*)::{s}.dedupgate_records) INTO v_taken FROM taken;

    RETURN QUERY
    SELECT a.*
    FROM unnest(p_ns, p_key, p_fp) WITH ORDINALITY AS u(ns, key, fp, i)
    LEFT JOIN unnest(v_taken) AS t ON t.namespace = u.ns AND t.key = u.key
    LEFT JOIN {s}.dedupgate_records AS r
           ON t.namespace IS NULL AND r.namespace = u.ns AND r.key = u.key
    CROSS JOIN LATERAL {s}.dedupgate_claim_answer(t, r, u.fp) AS a
    ORDER BY u.i;
END
$$;

-- Many marks of distinct keys at one instant, set-based, exactly as dedupgate_claim_distinct
-- does claims (the per-row logic is dedupgate_mark's).
CREATE FUNCTION {s}.dedupgate_mark_answer(t {s}.dedupgate_records, r {s}.dedupgate_records,
                                          p_fp bytea)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF t.namespace IS NOT NULL THEN
        RETURN ROW(1::smallint, t.state, t.fence, NULL, t.fingerprint, t.owner,
                   t.created_at_ms, t.expires_at_ms, t.lease_expires_at_ms,
                   t.completed_at_ms, t.result)::{s}.dedupgate_answer;
    END IF;
    IF r.namespace IS NULL THEN
        RAISE EXCEPTION 'dedupgate: a mark conflicted with an entry it cannot read';
    END IF;
    IF r.fingerprint IS NOT NULL AND p_fp IS NOT NULL AND r.fingerprint <> p_fp THEN
        RETURN ROW(3::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
    END IF;
    RETURN ROW(2::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
               r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
               r.completed_at_ms, r.result)::{s}.dedupgate_answer;
END
$$;

CREATE FUNCTION {s}.dedupgate_mark_distinct(p_ns bytea[], p_key bytea[], p_ttl_ms bigint[],
                                            p_fp bytea[], p_result bytea[])
RETURNS SETOF {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now   bigint := {s}.dedupgate_now_ms();
    v_taken {s}.dedupgate_records[];
BEGIN
    WITH taken AS (
        INSERT INTO {s}.dedupgate_records AS e
            (namespace, key, state, fence, token, fingerprint, owner, created_at_ms, expires_at_ms,
             lease_expires_at_ms, completed_at_ms, result)
        SELECT u.ns, u.key, 1, v_now * 1000, NULL, u.fp, NULL, v_now, v_now + u.ttl_ms, NULL,
               v_now, u.result
        FROM unnest(p_ns, p_key, p_ttl_ms, p_fp, p_result) AS u(ns, key, ttl_ms, fp, result)
        ORDER BY u.ns, u.key
        ON CONFLICT (namespace, key) DO UPDATE SET
            state = 1,
            fence = greatest(e.fence + 1, v_now * 1000),
            token = NULL,
            fingerprint = EXCLUDED.fingerprint,
            owner = NULL,
            created_at_ms = v_now,
            expires_at_ms = EXCLUDED.expires_at_ms,
            lease_expires_at_ms = NULL,
            completed_at_ms = v_now,
            result = EXCLUDED.result
        WHERE NOT (e.expires_at_ms > v_now AND e.state <> 2)
           OR (NOT (e.fingerprint IS NOT NULL AND EXCLUDED.fingerprint IS NOT NULL
                    AND e.fingerprint <> EXCLUDED.fingerprint)
               AND e.state = 0
               AND coalesce(e.lease_expires_at_ms <= v_now, false))
        RETURNING e.*
    )
    SELECT array_agg(ROW(taken.*)::{s}.dedupgate_records) INTO v_taken FROM taken;

    RETURN QUERY
    SELECT a.*
    FROM unnest(p_ns, p_key, p_fp) WITH ORDINALITY AS u(ns, key, fp, i)
    LEFT JOIN unnest(v_taken) AS t ON t.namespace = u.ns AND t.key = u.key
    LEFT JOIN {s}.dedupgate_records AS r
           ON t.namespace IS NULL AND r.namespace = u.ns AND r.key = u.key
    CROSS JOIN LATERAL {s}.dedupgate_mark_answer(t, r, u.fp) AS a
    ORDER BY u.i;
END
$$;

-- A batch: one call, one transaction, one commit. Ops run in array order, each through the same
-- function as a single op, so a later op sees an earlier one; a batch of claims only (or marks
-- only), all of distinct keys, goes set-based through dedupgate_claim_distinct (or
-- dedupgate_mark_distinct). p_kind: 1 claim, 2 mark,
-- 3 complete, 4 release, 5 extend, 6 get, 7 forget. Unused fields of an op are NULL.
CREATE FUNCTION {s}.dedupgate_apply_batch(p_kind smallint[], p_ns bytea[], p_key bytea[],
                                          p_ttl_ms bigint[], p_lease_ms bigint[], p_fp bytea[],
                                          p_owner bytea[], p_token bytea[], p_result bytea[])
RETURNS SETOF {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n integer := coalesce(array_length(p_kind, 1), 0);
BEGIN
    IF n > 1 AND (p_kind <@ ARRAY[1]::smallint[] OR p_kind <@ ARRAY[2]::smallint[])
       AND (SELECT count(*) FROM (SELECT DISTINCT ns, key FROM unnest(p_ns, p_key) AS u(ns, key)) d) = n
    THEN
        IF p_kind[1] = 1 THEN
            RETURN QUERY SELECT * FROM {s}.dedupgate_claim_distinct(p_ns, p_key, p_ttl_ms,
                                                                    p_lease_ms, p_fp, p_owner,
                                                                    p_token);
        ELSE
            RETURN QUERY SELECT * FROM {s}.dedupgate_mark_distinct(p_ns, p_key, p_ttl_ms, p_fp,
                                                                   p_result);
        END IF;
        RETURN;
    END IF;
    FOR i IN 1 .. n LOOP
        RETURN NEXT CASE p_kind[i]
            WHEN 1 THEN {s}.dedupgate_claim(p_ns[i], p_key[i], p_ttl_ms[i], p_lease_ms[i], p_fp[i],
                                           p_owner[i], p_token[i])
            WHEN 2 THEN {s}.dedupgate_mark(p_ns[i], p_key[i], p_ttl_ms[i], p_fp[i], p_result[i])
            WHEN 3 THEN {s}.dedupgate_complete(p_ns[i], p_key[i], p_token[i], p_result[i],
                                              p_ttl_ms[i])
            WHEN 4 THEN {s}.dedupgate_release(p_ns[i], p_key[i], p_token[i])
            WHEN 5 THEN {s}.dedupgate_extend(p_ns[i], p_key[i], p_token[i], p_lease_ms[i])
            WHEN 6 THEN {s}.dedupgate_get(p_ns[i], p_key[i])
            WHEN 7 THEN {s}.dedupgate_forget(p_ns[i], p_key[i])
        END;
    END LOOP;
END
$$;

-- The bounded sweeper: removes at most p_batch_max expired rows, skipping rows another
-- transaction holds (a claim about to take one over), and returns how many went.
CREATE FUNCTION {s}.dedupgate_sweep(p_batch_max integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint := {s}.dedupgate_now_ms();
    v_n   bigint;
BEGIN
    DELETE FROM {s}.dedupgate_records
    WHERE ctid IN (SELECT ctid FROM {s}.dedupgate_records
                   WHERE expires_at_ms <= v_now
                   LIMIT p_batch_max
                   FOR UPDATE SKIP LOCKED)
      AND expires_at_ms <= v_now;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN v_n;
END
$$;
