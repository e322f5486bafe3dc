-- dedupgate PostgreSQL functions: one per operation, over the objects of migrations/ (v1, v2).
--
-- `{s}` is replaced by the quoted schema name before this runs. They hold no data, so the store
-- re-creates all of them (this whole file, in the migration's transaction) whenever the md5 of
-- this text differs from the one recorded in {s}.dedupgate_schema_functions; see schema.rs.
--
-- Every operation is one call of one function below. Each function re-expresses
-- dedupgate_core::decide (crates/dedupgate-core/src/decide.rs) for one operation; the
-- conformance suite keeps them equal. Conventions shared by all of them:
--
-- * Time: `{s}.dedupgate_now_ms()` = clock_timestamp() in unix milliseconds. An operation is
--   decided on a clock read taken AFTER the row lock it decides under is held (or, for a
--   duplicate answered from an unlocked read, after that read): a clock read before a lock wait
--   would judge the entry at an instant long past when the operation takes effect (a claim that
--   waited while a record expired would answer "duplicate" with an expired record, and a claim
--   granted after a wait would get a lease that started in the past). Not now(): now() is frozen
--   at the start of the transaction, so inside a caller's long transaction (the transactional
--   API) or a batch a lease would start in the past.
-- * A key that has no row cannot be locked before it is inserted: the insert is
--   `ON CONFLICT DO NOTHING` with a clock read just before it. If it conflicts (another
--   transaction inserted the key, possibly after we waited for it) the function locks the row
--   that now exists, reads the clock again and decides on that. If it succeeds but the clock
--   moved while it ran (it may have waited for another transaction's insert of the key that then
--   rolled back), the new row is stamped again with a fresh read, which it holds.
-- * An entry is live while now_ms < expires_at_ms and state <> released (2). A dead entry is
--   absent for every answer, but its fence still counts for the next claim.
-- * Answer codes: 1 ok (new / completed / released / extended / found / forgotten),
--   2 duplicate, 3 fingerprint mismatch, 4 lease lost, 5 absent (get, forget).
--
-- Answers are built inline as ROW(code, <entry columns>)::dedupgate_answer, never through a
-- helper SQL function: PostgreSQL does not inline SQL functions that return a composite, and
-- calling one per operation doubled the CPU cost of a claim.

-- Before this runs the store drops every function of the schema named dedupgate_*, whatever its
-- signature, so a changed signature leaves no stale overload behind.

-- date_part, not extract: since PostgreSQL 14 extract returns numeric, and numeric arithmetic
-- made this read cost ~2 µs, a sixth of a new key's cost in a batch of claims; date_part's
-- double costs ~0.4 µs. Its floor equals numeric extract's to the millisecond until 2038 (epoch
-- 2^31 s; checked on 6 million instants at millisecond boundaries); later a boundary may read
-- 1 ms low. Every step is monotone, so the clock stays non-decreasing either way.
CREATE FUNCTION {s}.dedupgate_now_ms() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT floor(date_part('epoch', clock_timestamp()) * 1000)::bigint
$$;

-- Claim. An unlocked read first answers a duplicate (or mismatch) without a lock; anything else
-- is decided under the row lock: a held row is taken over or renewed by UPDATE, a missing key is
-- inserted. Each pass of the loop reads the clock after the read or lock it decides on.
CREATE FUNCTION {s}.dedupgate_claim(p_ns bytea, p_key bytea, p_ttl_ms bigint, p_lease_ms bigint,
                                    p_fp bytea, p_owner bytea, p_token bytea)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now    bigint;
    v_lease  bigint;
    v_found  boolean;
    v_locked boolean := false;
    v_passes integer := 0;
    r        {s}.dedupgate_records;
BEGIN
    -- A plain MVCC read without a lock: an entry that is live and that this claim may neither
    -- take over nor renew is answered as it was committed, and the answer writes nothing (no row
    -- lock, so no WAL and no commit flush for a duplicate). It is the answer of a claim
    -- serialized at the read, and the entry is still live at the clock read after it.
    SELECT * INTO r FROM {s}.dedupgate_records WHERE namespace = p_ns AND key = p_key;
    v_found := FOUND;
    LOOP
        v_now := {s}.dedupgate_now_ms();
        v_lease := v_now + p_lease_ms;
        IF v_found AND r.expires_at_ms > v_now AND r.state <> 2 THEN
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
            IF v_locked AND coalesce(r.owner = p_owner, false) THEN
                -- Renew: the same worker again keeps token and fence, with a lease that
                -- never ends before the one it renews.
                v_lease := greatest(r.lease_expires_at_ms, v_lease);
                UPDATE {s}.dedupgate_records SET
                    lease_expires_at_ms = v_lease,
                    expires_at_ms = greatest(r.expires_at_ms, v_lease)
                WHERE namespace = p_ns AND key = p_key
                RETURNING * INTO r;
                RETURN ROW(1::smallint, r.state, r.fence, r.token, r.fingerprint, r.owner,
                           r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                           r.completed_at_ms, r.result)::{s}.dedupgate_answer;
            END IF;
        END IF;
        IF v_locked AND v_found THEN
            -- Take over a dead entry or a passed lease (the live cases were answered above).
            UPDATE {s}.dedupgate_records SET
                state = 0,
                fence = greatest(r.fence + 1, v_now * 1000),
                token = p_token,
                fingerprint = p_fp,
                owner = p_owner,
                created_at_ms = v_now,
                expires_at_ms = greatest(v_now + p_ttl_ms, v_lease),
                lease_expires_at_ms = v_lease,
                completed_at_ms = NULL,
                result = NULL,
                ttl_ms = p_ttl_ms
            WHERE namespace = p_ns AND key = p_key
            RETURNING * INTO r;
            RETURN ROW(1::smallint, r.state, r.fence, r.token, r.fingerprint, r.owner,
                       r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                       r.completed_at_ms, r.result)::{s}.dedupgate_answer;
        END IF;
        IF NOT v_found THEN
            INSERT INTO {s}.dedupgate_records
                (namespace, key, state, fence, token, fingerprint, owner, created_at_ms,
                 expires_at_ms, lease_expires_at_ms, completed_at_ms, result, ttl_ms)
            VALUES (p_ns, p_key, 0, v_now * 1000, p_token, p_fp, p_owner, v_now,
                    greatest(v_now + p_ttl_ms, v_lease), v_lease, NULL, NULL, p_ttl_ms)
            ON CONFLICT (namespace, key) DO NOTHING
            RETURNING * INTO r;
            IF FOUND THEN
                v_now := {s}.dedupgate_now_ms();
                IF v_now > r.created_at_ms THEN
                    -- The insert took time (perhaps a wait): stamp the row we hold again.
                    v_lease := v_now + p_lease_ms;
                    UPDATE {s}.dedupgate_records SET
                        fence = greatest(r.fence + 1, v_now * 1000),
                        created_at_ms = v_now,
                        expires_at_ms = greatest(v_now + p_ttl_ms, v_lease),
                        lease_expires_at_ms = v_lease
                    WHERE namespace = p_ns AND key = p_key
                    RETURNING * INTO r;
                END IF;
                RETURN ROW(1::smallint, r.state, r.fence, r.token, r.fingerprint, r.owner,
                           r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                           r.completed_at_ms, r.result)::{s}.dedupgate_answer;
            END IF;
        END IF;
        -- Not decided yet (a takeable entry seen without a lock, or an insert that conflicted):
        -- lock the row, then decide again on a fresh clock read.
        v_passes := v_passes + 1;
        IF v_passes > 8 THEN
            RAISE EXCEPTION 'dedupgate: a claim found no stable entry after % attempts', v_passes;
        END IF;
        SELECT * INTO r FROM {s}.dedupgate_records
            WHERE namespace = p_ns AND key = p_key FOR UPDATE;
        v_found := FOUND;
        v_locked := true;
    END LOOP;
END
$$;

-- Mark: like claim, but the entry it makes is completed at once and it never renews.
CREATE FUNCTION {s}.dedupgate_mark(p_ns bytea, p_key bytea, p_ttl_ms bigint, p_fp bytea,
                                   p_result bytea)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now    bigint;
    v_found  boolean;
    v_locked boolean := false;
    v_passes integer := 0;
    r        {s}.dedupgate_records;
BEGIN
    -- Duplicates from a plain read without a lock, as in dedupgate_claim.
    SELECT * INTO r FROM {s}.dedupgate_records WHERE namespace = p_ns AND key = p_key;
    v_found := FOUND;
    LOOP
        v_now := {s}.dedupgate_now_ms();
        IF v_found AND r.expires_at_ms > v_now AND r.state <> 2 THEN
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
        IF v_locked AND v_found THEN
            UPDATE {s}.dedupgate_records SET
                state = 1,
                fence = greatest(r.fence + 1, v_now * 1000),
                token = NULL,
                fingerprint = p_fp,
                owner = NULL,
                created_at_ms = v_now,
                expires_at_ms = v_now + p_ttl_ms,
                lease_expires_at_ms = NULL,
                completed_at_ms = v_now,
                result = p_result,
                ttl_ms = NULL -- the taken claim's: in_progress rows only (v2.sql)
            WHERE namespace = p_ns AND key = p_key
            RETURNING * INTO r;
            RETURN ROW(1::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
                       r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                       r.completed_at_ms, r.result)::{s}.dedupgate_answer;
        END IF;
        IF NOT v_found THEN
            INSERT INTO {s}.dedupgate_records
                (namespace, key, state, fence, token, fingerprint, owner, created_at_ms,
                 expires_at_ms, lease_expires_at_ms, completed_at_ms, result)
            VALUES (p_ns, p_key, 1, v_now * 1000, NULL, p_fp, NULL, v_now, v_now + p_ttl_ms,
                    NULL, v_now, p_result)
            ON CONFLICT (namespace, key) DO NOTHING
            RETURNING * INTO r;
            IF FOUND THEN
                v_now := {s}.dedupgate_now_ms();
                IF v_now > r.created_at_ms THEN
                    UPDATE {s}.dedupgate_records SET
                        fence = greatest(r.fence + 1, v_now * 1000),
                        created_at_ms = v_now,
                        expires_at_ms = v_now + p_ttl_ms,
                        completed_at_ms = v_now
                    WHERE namespace = p_ns AND key = p_key
                    RETURNING * INTO r;
                END IF;
                RETURN ROW(1::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
                           r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                           r.completed_at_ms, r.result)::{s}.dedupgate_answer;
            END IF;
        END IF;
        v_passes := v_passes + 1;
        IF v_passes > 8 THEN
            RAISE EXCEPTION 'dedupgate: a mark found no stable entry after % attempts', v_passes;
        END IF;
        SELECT * INTO r FROM {s}.dedupgate_records
            WHERE namespace = p_ns AND key = p_key FOR UPDATE;
        v_found := FOUND;
        v_locked := true;
    END LOOP;
END
$$;

-- Complete: only the current token of a live entry. A retried complete (entry already completed
-- with this token) is answered with the stored record and changes nothing. The record is kept
-- p_ttl_ms from now when given, else until the claim's ttl ends (created_at_ms + ttl_ms, but at
-- least least(ttl_ms, 10000) past now: 10000 is dedupgate_core::COMPLETE_GRACE_MS, so a retried
-- complete is answered again when the work outlasted its ttl), not the lease end that may have
-- held the claim's expiry later; a row without ttl_ms (claimed before schema v2) keeps its expiry.
CREATE FUNCTION {s}.dedupgate_complete(p_ns bytea, p_key bytea, p_token bytea, p_result bytea,
                                       p_ttl_ms bigint)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint;
    r     {s}.dedupgate_records;
BEGIN
    SELECT * INTO r FROM {s}.dedupgate_records
        WHERE namespace = p_ns AND key = p_key FOR UPDATE;
    v_now := {s}.dedupgate_now_ms();
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
            expires_at_ms = CASE WHEN p_ttl_ms IS NOT NULL THEN v_now + p_ttl_ms
                                 WHEN ttl_ms IS NOT NULL
                                 THEN greatest(created_at_ms + ttl_ms,
                                               v_now + least(ttl_ms, 10000))
                                 ELSE expires_at_ms END,
            ttl_ms = NULL
        WHERE namespace = p_ns AND key = p_key
        RETURNING * INTO r;
    END IF;
    RETURN ROW(1::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
                   r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
                   r.completed_at_ms, r.result)::{s}.dedupgate_answer;
END
$$;

-- Release: the holder gives the key back; the entry becomes a tombstone that keeps the fence,
-- so the next claim's fence is higher. A released token is no longer the holder's: a second
-- release answers lease_lost (API.md).
CREATE FUNCTION {s}.dedupgate_release(p_ns bytea, p_key bytea, p_token bytea)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint;
    r     {s}.dedupgate_records;
BEGIN
    SELECT * INTO r FROM {s}.dedupgate_records
        WHERE namespace = p_ns AND key = p_key FOR UPDATE;
    v_now := {s}.dedupgate_now_ms();
    IF NOT FOUND OR r.expires_at_ms <= v_now OR r.token IS NULL OR r.token <> p_token
       OR r.state <> 0 THEN
        RETURN ROW(4::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
    END IF;
    UPDATE {s}.dedupgate_records SET state = 2, lease_expires_at_ms = NULL, result = NULL,
                                     ttl_ms = NULL -- in_progress rows only (v2.sql)
    WHERE namespace = p_ns AND key = p_key;
    RETURN ROW(1::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
END
$$;

-- Extend: renew the lease of the current holder; the record lives at least as long as the lease.
CREATE FUNCTION {s}.dedupgate_extend(p_ns bytea, p_key bytea, p_token bytea, p_lease_ms bigint)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now   bigint;
    v_lease bigint;
    r       {s}.dedupgate_records;
BEGIN
    SELECT * INTO r FROM {s}.dedupgate_records
        WHERE namespace = p_ns AND key = p_key FOR UPDATE;
    v_now := {s}.dedupgate_now_ms();
    IF NOT FOUND OR r.expires_at_ms <= v_now OR r.state <> 0
       OR r.token IS NULL OR r.token <> p_token THEN
        RETURN ROW(4::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
    END IF;
    v_lease := v_now + p_lease_ms;
    UPDATE {s}.dedupgate_records SET
        lease_expires_at_ms = v_lease,
        expires_at_ms = greatest(expires_at_ms, v_lease)
    WHERE namespace = p_ns AND key = p_key
    RETURNING * INTO r;
    RETURN ROW(1::smallint, r.state, r.fence, NULL, r.fingerprint, r.owner,
               r.created_at_ms, r.expires_at_ms, r.lease_expires_at_ms,
               r.completed_at_ms, r.result)::{s}.dedupgate_answer;
END
$$;

-- Get: a plain read, judged on a clock read after it.
CREATE FUNCTION {s}.dedupgate_get(p_ns bytea, p_key bytea)
RETURNS {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r {s}.dedupgate_records;
BEGIN
    SELECT * INTO r FROM {s}.dedupgate_records WHERE namespace = p_ns AND key = p_key;
    IF FOUND AND r.expires_at_ms > {s}.dedupgate_now_ms() AND r.state <> 2 THEN
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
    r {s}.dedupgate_records;
BEGIN
    SELECT * INTO r FROM {s}.dedupgate_records
        WHERE namespace = p_ns AND key = p_key FOR UPDATE;
    IF FOUND AND r.expires_at_ms > {s}.dedupgate_now_ms() AND r.state <> 2 THEN
        UPDATE {s}.dedupgate_records SET
            state = 2, token = NULL, lease_expires_at_ms = NULL, result = NULL, ttl_ms = NULL
        WHERE namespace = p_ns AND key = p_key;
        RETURN ROW(1::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
    END IF;
    RETURN ROW(5::smallint, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                   NULL)::{s}.dedupgate_answer;
END
$$;

-- Many claims of distinct keys, set-based, with exactly the per-row logic of dedupgate_claim.
-- First a plain read of all the keys' rows and a clock read after it: the keys that are live
-- duplicates (or mismatches) at that instant are answered from the read, lock-free, as the
-- single claim does. Then each pass over the keys still undecided:
--   1. inserts the keys that have no row, in (namespace, key) order, ON CONFLICT DO NOTHING, each
--      row stamped with a clock read as it goes in (and stamped again if the clock moved during
--      its insert, which may have waited for another transaction's insert that rolled back);
--   2. locks the rows of the other keys, in (namespace, key) order, so concurrent batches cannot
--      deadlock on them, and only then reads the clock;
--   3. takes over or renews the held rows that may be taken (one UPDATE), and answers the other
--      held rows duplicate or mismatch.
-- A key whose row vanished between 1 and 2 (swept) is left for the next pass. As the keys are
-- distinct no op can see another's effect, so this equals the ops one by one. Every row
-- decided under a lock is held by this transaction, so the final read returns exactly the
-- versions decided on. A batch of new keys costs the read, one INSERT and the final read; a batch
-- of duplicates costs the read and writes nothing; the lock statement runs only when a key had a
-- row that may be taken.
CREATE FUNCTION {s}.dedupgate_claim_distinct(p_ns bytea[], p_key bytea[], p_ttl_ms bigint[],
                                             p_lease_ms bigint[], p_fp bytea[], p_owner bytea[],
                                             p_token bytea[])
RETURNS SETOF {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_n      integer := coalesce(array_length(p_ns, 1), 0);
    v_now    bigint;
    v_passes integer := 0;
    v_inserted bigint;
    -- Rows read without a lock, then the ones answered from that read.
    f_all    {s}.dedupgate_records[];
    f_rows   {s}.dedupgate_records[];
    -- Rows this call inserted and did not stamp again: answered as inserted, not read again.
    a_rows   {s}.dedupgate_records[] := '{}';
    -- The ops not decided yet.
    t_ns     bytea[] := p_ns;
    t_key    bytea[] := p_key;
    t_ttl    bigint[] := p_ttl_ms;
    t_lease  bigint[] := p_lease_ms;
    t_fp     bytea[] := p_fp;
    t_owner  bytea[] := p_owner;
    t_token  bytea[] := p_token;
    -- The rows held (locked) in this pass.
    h_ns     bytea[];
    h_key    bytea[];
    -- Inserted rows to stamp again.
    s_ns     bytea[];
    s_key    bytea[];
    -- The decided keys and their answer codes.
    d_ns     bytea[] := '{}';
    d_key    bytea[] := '{}';
    d_code   smallint[] := '{}';
BEGIN
    -- Lock-free answers first, as in the single op: a key whose row is live at a clock read
    -- taken after this plain read, and that this op may neither take over nor renew, is answered
    -- from the read (duplicate or mismatch) and writes nothing.
    SELECT array_agg(e) INTO f_all
    FROM {s}.dedupgate_records AS e
    JOIN unnest(p_ns, p_key) AS u(ns, key) ON e.namespace = u.ns AND e.key = u.key;
    IF f_all IS NOT NULL THEN
        v_now := {s}.dedupgate_now_ms();
        SELECT array_agg(ROW(e.*)::{s}.dedupgate_records), array_agg(e.namespace),
               array_agg(e.key),
               array_agg(CASE WHEN e.fingerprint IS NOT NULL AND u.fp IS NOT NULL
                                   AND e.fingerprint <> u.fp THEN 3 ELSE 2 END::smallint)
        INTO f_rows, d_ns, d_key, d_code
        FROM unnest(f_all) AS e
        JOIN unnest(t_ns, t_key, t_ttl, t_lease, t_fp, t_owner, t_token) AS u(ns, key, ttl_ms, lease_ms, fp, owner, token)
          ON e.namespace = u.ns AND e.key = u.key
        WHERE e.expires_at_ms > v_now AND e.state <> 2
          AND ((e.fingerprint IS NOT NULL AND u.fp IS NOT NULL AND e.fingerprint <> u.fp)
               OR NOT (e.state = 0 AND (coalesce(e.owner = u.owner, false)
                                        OR coalesce(e.lease_expires_at_ms <= v_now, false))));
        d_ns := coalesce(d_ns, '{}');
        d_key := coalesce(d_key, '{}');
        d_code := coalesce(d_code, '{}');
        IF array_length(d_ns, 1) = v_n THEN
            t_ns := NULL;
        ELSIF array_length(d_ns, 1) > 0 THEN
            SELECT array_agg(u.ns), array_agg(u.key), array_agg(u.ttl_ms), array_agg(u.lease_ms), array_agg(u.fp), array_agg(u.owner), array_agg(u.token)
            INTO t_ns, t_key, t_ttl, t_lease, t_fp, t_owner, t_token
            FROM unnest(t_ns, t_key, t_ttl, t_lease, t_fp, t_owner, t_token) AS u(ns, key, ttl_ms, lease_ms, fp, owner, token)
            WHERE NOT EXISTS (SELECT 1 FROM unnest(d_ns, d_key) AS d(ns, key)
                              WHERE d.ns = u.ns AND d.key = u.key);
        END IF;
    END IF;

    WHILE t_ns IS NOT NULL LOOP
        v_passes := v_passes + 1;
        IF v_passes > 8 THEN
            RAISE EXCEPTION 'dedupgate: a batch of claims found no stable entries after % passes',
                v_passes;
        END IF;
        WITH u AS (
            -- Not flattened (a volatile target), and sorted before the clock is read, so each
            -- row's clock read comes just before its insert.
            SELECT u.*, {s}.dedupgate_now_ms() AS now_ms
            FROM (SELECT u.* FROM unnest(t_ns, t_key, t_ttl, t_lease, t_fp, t_owner, t_token)
                               AS u(ns, key, ttl_ms, lease_ms, fp, owner, token)
                  ORDER BY u.ns, u.key OFFSET 0) AS u
        ), ins AS (
            INSERT INTO {s}.dedupgate_records AS n
                (namespace, key, state, fence, token, fingerprint, owner, created_at_ms,
                 expires_at_ms, lease_expires_at_ms, completed_at_ms, result, ttl_ms)
            SELECT u.ns, u.key, 0, u.now_ms * 1000, u.token, u.fp, u.owner, u.now_ms,
                   greatest(u.now_ms + u.ttl_ms, u.now_ms + u.lease_ms), u.now_ms + u.lease_ms,
                   NULL, NULL, u.ttl_ms
            FROM u
            ON CONFLICT (namespace, key) DO NOTHING
            RETURNING n.namespace, n.key, n.created_at_ms, {s}.dedupgate_now_ms() AS after_ms,
                      n AS rec
        )
        SELECT d_ns || coalesce(array_agg(ins.namespace), '{}'),
               d_key || coalesce(array_agg(ins.key), '{}'),
               d_code || coalesce(array_agg(1::smallint), '{}'),
               array_agg(ins.namespace) FILTER (WHERE ins.after_ms > ins.created_at_ms),
               array_agg(ins.key) FILTER (WHERE ins.after_ms > ins.created_at_ms),
               a_rows || coalesce(array_agg(ins.rec) FILTER (WHERE ins.after_ms <= ins.created_at_ms),
                                  '{}'),
               count(*)
        INTO d_ns, d_key, d_code, s_ns, s_key, a_rows, v_inserted
        FROM ins;

        IF s_ns IS NOT NULL THEN
            v_now := {s}.dedupgate_now_ms();
            UPDATE {s}.dedupgate_records AS e SET
                fence = greatest(e.fence + 1, v_now * 1000),
                created_at_ms = v_now,
                expires_at_ms = greatest(v_now + u.ttl_ms, v_now + u.lease_ms),
                lease_expires_at_ms = v_now + u.lease_ms
            FROM unnest(t_ns, t_key, t_ttl, t_lease) AS u(ns, key, ttl_ms, lease_ms)
            JOIN unnest(s_ns, s_key) AS s(ns, key) ON s.ns = u.ns AND s.key = u.key
            WHERE e.namespace = u.ns AND e.key = u.key;
        END IF;

        -- The keys that had a row (or got one from another transaction meanwhile): lock them,
        -- in key order, then read the clock and decide on them.
        h_ns := NULL;
        h_key := NULL;
        IF v_inserted < coalesce(array_length(t_ns, 1), 0) THEN
            SELECT array_agg(l.namespace), array_agg(l.key) INTO h_ns, h_key FROM (
                SELECT e.namespace, e.key FROM {s}.dedupgate_records AS e
                JOIN unnest(t_ns, t_key) AS u(ns, key) ON e.namespace = u.ns AND e.key = u.key
                WHERE NOT EXISTS (SELECT 1 FROM unnest(d_ns, d_key) AS d(ns, key)
                                  WHERE d.ns = u.ns AND d.key = u.key)
                ORDER BY e.namespace, e.key
                FOR UPDATE OF e) AS l;
            v_now := {s}.dedupgate_now_ms();

            IF h_ns IS NOT NULL THEN
                WITH u AS (
                    SELECT u.* FROM unnest(t_ns, t_key, t_ttl, t_lease, t_fp, t_owner, t_token)
                             AS u(ns, key, ttl_ms, lease_ms, fp, owner, token)
                    JOIN unnest(h_ns, h_key) AS h(ns, key) ON h.ns = u.ns AND h.key = u.key
                ), taken AS (
                    UPDATE {s}.dedupgate_records AS e SET
                        fence = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = u.owner
                                     THEN e.fence ELSE greatest(e.fence + 1, v_now * 1000) END,
                        token = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = u.owner
                                     THEN e.token ELSE u.token END,
                        fingerprint = CASE WHEN e.expires_at_ms > v_now AND e.state = 0
                                                AND e.owner = u.owner
                                     THEN e.fingerprint ELSE u.fp END,
                        owner = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = u.owner
                                     THEN e.owner ELSE u.owner END,
                        created_at_ms = CASE WHEN e.expires_at_ms > v_now AND e.state = 0
                                                  AND e.owner = u.owner
                                     THEN e.created_at_ms ELSE v_now END,
                        expires_at_ms = CASE WHEN e.expires_at_ms > v_now AND e.state = 0
                                                  AND e.owner = u.owner
                                     THEN greatest(e.expires_at_ms, v_now + u.lease_ms)
                                     ELSE greatest(v_now + u.ttl_ms, v_now + u.lease_ms) END,
                        state = 0,
                        lease_expires_at_ms = CASE WHEN e.expires_at_ms > v_now AND e.state = 0
                                                        AND e.owner = u.owner
                                     THEN greatest(e.lease_expires_at_ms, v_now + u.lease_ms)
                                     ELSE v_now + u.lease_ms END,
                        ttl_ms = CASE WHEN e.expires_at_ms > v_now AND e.state = 0 AND e.owner = u.owner
                                      THEN e.ttl_ms ELSE u.ttl_ms END,
                        completed_at_ms = NULL,
                        result = NULL
                    FROM u
                    WHERE e.namespace = u.ns AND e.key = u.key
                      AND (NOT (e.expires_at_ms > v_now AND e.state <> 2)
                           OR (NOT (e.fingerprint IS NOT NULL AND u.fp IS NOT NULL
                                    AND e.fingerprint <> u.fp)
                               AND e.state = 0
                               AND (coalesce(e.owner = u.owner, false)
                                    OR coalesce(e.lease_expires_at_ms <= v_now, false))))
                    RETURNING e.namespace, e.key
                )
                -- The held rows as this statement's snapshot sees them: as they were locked.
                SELECT d_ns || array_agg(u.ns), d_key || array_agg(u.key),
                       d_code || array_agg(CASE
                           WHEN t.key IS NOT NULL THEN 1
                           WHEN e.fingerprint IS NOT NULL AND u.fp IS NOT NULL
                                AND e.fingerprint <> u.fp THEN 3
                           ELSE 2 END::smallint)
                INTO d_ns, d_key, d_code
                FROM u
                JOIN {s}.dedupgate_records AS e ON e.namespace = u.ns AND e.key = u.key
                LEFT JOIN taken AS t ON t.namespace = u.ns AND t.key = u.key;
            END IF;
        END IF;

        EXIT WHEN array_length(d_ns, 1) IS NOT DISTINCT FROM v_n OR v_n = 0;
        SELECT array_agg(u.ns), array_agg(u.key), array_agg(u.ttl_ms), array_agg(u.lease_ms),
               array_agg(u.fp), array_agg(u.owner), array_agg(u.token)
        INTO t_ns, t_key, t_ttl, t_lease, t_fp, t_owner, t_token
        FROM unnest(t_ns, t_key, t_ttl, t_lease, t_fp, t_owner, t_token)
             AS u(ns, key, ttl_ms, lease_ms, fp, owner, token)
        WHERE NOT EXISTS (SELECT 1 FROM unnest(d_ns, d_key) AS d(ns, key)
                          WHERE d.ns = u.ns AND d.key = u.key);
    END LOOP;

    RETURN QUERY
    -- f (a row answered from the lock-free read, or one this call inserted, as inserted: it
    -- holds it) and r (any other row this call holds, read now) never both join.
    SELECT d.code, coalesce(f.state, r.state), coalesce(f.fence, r.fence),
           CASE WHEN d.code = 1 THEN coalesce(f.token, r.token) END,
           coalesce(f.fingerprint, r.fingerprint),
           coalesce(f.owner, r.owner), coalesce(f.created_at_ms, r.created_at_ms),
           coalesce(f.expires_at_ms, r.expires_at_ms),
           coalesce(f.lease_expires_at_ms, r.lease_expires_at_ms),
           coalesce(f.completed_at_ms, r.completed_at_ms), coalesce(f.result, r.result)
    FROM unnest(p_ns, p_key) WITH ORDINALITY AS u(ns, key, i)
    JOIN unnest(d_ns, d_key, d_code) AS d(ns, key, code) ON d.ns = u.ns AND d.key = u.key
    LEFT JOIN unnest(f_rows || a_rows) AS f
           ON d.code <> 3 AND f.namespace = u.ns AND f.key = u.key
    -- A subquery kept apart (OFFSET 0), so that the test on f gates its index probe instead of
    -- filtering the row the probe found: most rows of a batch of new keys are in a_rows.
    LEFT JOIN LATERAL (
        SELECT r.* FROM {s}.dedupgate_records AS r
        WHERE d.code <> 3 AND f.namespace IS NULL AND r.namespace = u.ns AND r.key = u.key
        OFFSET 0) AS r ON true
    ORDER BY u.i;
END
$$;

-- Many marks of distinct keys, set-based, exactly as dedupgate_claim_distinct does claims (the
-- per-row logic is dedupgate_mark's).
CREATE FUNCTION {s}.dedupgate_mark_distinct(p_ns bytea[], p_key bytea[], p_ttl_ms bigint[],
                                            p_fp bytea[], p_result bytea[])
RETURNS SETOF {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_n      integer := coalesce(array_length(p_ns, 1), 0);
    v_now    bigint;
    v_passes integer := 0;
    v_inserted bigint;
    -- Rows read without a lock, then the ones answered from that read.
    f_all    {s}.dedupgate_records[];
    f_rows   {s}.dedupgate_records[];
    -- Rows this call inserted and did not stamp again: answered as inserted, not read again.
    a_rows   {s}.dedupgate_records[] := '{}';
    t_ns     bytea[] := p_ns;
    t_key    bytea[] := p_key;
    t_ttl    bigint[] := p_ttl_ms;
    t_fp     bytea[] := p_fp;
    t_result bytea[] := p_result;
    h_ns     bytea[];
    h_key    bytea[];
    s_ns     bytea[];
    s_key    bytea[];
    d_ns     bytea[] := '{}';
    d_key    bytea[] := '{}';
    d_code   smallint[] := '{}';
BEGIN
    -- Lock-free answers first, as in the single op: a key whose row is live at a clock read
    -- taken after this plain read, and that this op may neither take over nor renew, is answered
    -- from the read (duplicate or mismatch) and writes nothing.
    SELECT array_agg(e) INTO f_all
    FROM {s}.dedupgate_records AS e
    JOIN unnest(p_ns, p_key) AS u(ns, key) ON e.namespace = u.ns AND e.key = u.key;
    IF f_all IS NOT NULL THEN
        v_now := {s}.dedupgate_now_ms();
        SELECT array_agg(ROW(e.*)::{s}.dedupgate_records), array_agg(e.namespace),
               array_agg(e.key),
               array_agg(CASE WHEN e.fingerprint IS NOT NULL AND u.fp IS NOT NULL
                                   AND e.fingerprint <> u.fp THEN 3 ELSE 2 END::smallint)
        INTO f_rows, d_ns, d_key, d_code
        FROM unnest(f_all) AS e
        JOIN unnest(t_ns, t_key, t_ttl, t_fp, t_result) AS u(ns, key, ttl_ms, fp, result)
          ON e.namespace = u.ns AND e.key = u.key
        WHERE e.expires_at_ms > v_now AND e.state <> 2
          AND ((e.fingerprint IS NOT NULL AND u.fp IS NOT NULL AND e.fingerprint <> u.fp)
               OR NOT (e.state = 0 AND coalesce(e.lease_expires_at_ms <= v_now, false)));
        d_ns := coalesce(d_ns, '{}');
        d_key := coalesce(d_key, '{}');
        d_code := coalesce(d_code, '{}');
        IF array_length(d_ns, 1) = v_n THEN
            t_ns := NULL;
        ELSIF array_length(d_ns, 1) > 0 THEN
            SELECT array_agg(u.ns), array_agg(u.key), array_agg(u.ttl_ms), array_agg(u.fp), array_agg(u.result)
            INTO t_ns, t_key, t_ttl, t_fp, t_result
            FROM unnest(t_ns, t_key, t_ttl, t_fp, t_result) AS u(ns, key, ttl_ms, fp, result)
            WHERE NOT EXISTS (SELECT 1 FROM unnest(d_ns, d_key) AS d(ns, key)
                              WHERE d.ns = u.ns AND d.key = u.key);
        END IF;
    END IF;

    WHILE t_ns IS NOT NULL LOOP
        v_passes := v_passes + 1;
        IF v_passes > 8 THEN
            RAISE EXCEPTION 'dedupgate: a batch of marks found no stable entries after % passes',
                v_passes;
        END IF;
        WITH u AS (
            SELECT u.*, {s}.dedupgate_now_ms() AS now_ms
            FROM (SELECT u.* FROM unnest(t_ns, t_key, t_ttl, t_fp, t_result)
                               AS u(ns, key, ttl_ms, fp, result)
                  ORDER BY u.ns, u.key OFFSET 0) AS u
        ), ins AS (
            INSERT INTO {s}.dedupgate_records AS n
                (namespace, key, state, fence, token, fingerprint, owner, created_at_ms,
                 expires_at_ms, lease_expires_at_ms, completed_at_ms, result)
            SELECT u.ns, u.key, 1, u.now_ms * 1000, NULL, u.fp, NULL, u.now_ms,
                   u.now_ms + u.ttl_ms, NULL, u.now_ms, u.result
            FROM u
            ON CONFLICT (namespace, key) DO NOTHING
            RETURNING n.namespace, n.key, n.created_at_ms, {s}.dedupgate_now_ms() AS after_ms,
                      n AS rec
        )
        SELECT d_ns || coalesce(array_agg(ins.namespace), '{}'),
               d_key || coalesce(array_agg(ins.key), '{}'),
               d_code || coalesce(array_agg(1::smallint), '{}'),
               array_agg(ins.namespace) FILTER (WHERE ins.after_ms > ins.created_at_ms),
               array_agg(ins.key) FILTER (WHERE ins.after_ms > ins.created_at_ms),
               a_rows || coalesce(array_agg(ins.rec) FILTER (WHERE ins.after_ms <= ins.created_at_ms),
                                  '{}'),
               count(*)
        INTO d_ns, d_key, d_code, s_ns, s_key, a_rows, v_inserted
        FROM ins;

        IF s_ns IS NOT NULL THEN
            v_now := {s}.dedupgate_now_ms();
            UPDATE {s}.dedupgate_records AS e SET
                fence = greatest(e.fence + 1, v_now * 1000),
                created_at_ms = v_now,
                expires_at_ms = v_now + u.ttl_ms,
                completed_at_ms = v_now
            FROM unnest(t_ns, t_key, t_ttl) AS u(ns, key, ttl_ms)
            JOIN unnest(s_ns, s_key) AS s(ns, key) ON s.ns = u.ns AND s.key = u.key
            WHERE e.namespace = u.ns AND e.key = u.key;
        END IF;

        -- The keys that had a row (or got one from another transaction meanwhile): lock them,
        -- in key order, then read the clock and decide on them.
        h_ns := NULL;
        h_key := NULL;
        IF v_inserted < coalesce(array_length(t_ns, 1), 0) THEN
            SELECT array_agg(l.namespace), array_agg(l.key) INTO h_ns, h_key FROM (
                SELECT e.namespace, e.key FROM {s}.dedupgate_records AS e
                JOIN unnest(t_ns, t_key) AS u(ns, key) ON e.namespace = u.ns AND e.key = u.key
                WHERE NOT EXISTS (SELECT 1 FROM unnest(d_ns, d_key) AS d(ns, key)
                                  WHERE d.ns = u.ns AND d.key = u.key)
                ORDER BY e.namespace, e.key
                FOR UPDATE OF e) AS l;
            v_now := {s}.dedupgate_now_ms();

            IF h_ns IS NOT NULL THEN
                WITH u AS (
                    SELECT u.* FROM unnest(t_ns, t_key, t_ttl, t_fp, t_result)
                             AS u(ns, key, ttl_ms, fp, result)
                    JOIN unnest(h_ns, h_key) AS h(ns, key) ON h.ns = u.ns AND h.key = u.key
                ), taken AS (
                    UPDATE {s}.dedupgate_records AS e SET
                        state = 1,
                        fence = greatest(e.fence + 1, v_now * 1000),
                        token = NULL,
                        fingerprint = u.fp,
                        owner = NULL,
                        created_at_ms = v_now,
                        expires_at_ms = v_now + u.ttl_ms,
                        lease_expires_at_ms = NULL,
                        completed_at_ms = v_now,
                        result = u.result,
                        ttl_ms = NULL
                    FROM u
                    WHERE e.namespace = u.ns AND e.key = u.key
                      AND (NOT (e.expires_at_ms > v_now AND e.state <> 2)
                           OR (NOT (e.fingerprint IS NOT NULL AND u.fp IS NOT NULL
                                    AND e.fingerprint <> u.fp)
                               AND e.state = 0
                               AND coalesce(e.lease_expires_at_ms <= v_now, false)))
                    RETURNING e.namespace, e.key
                )
                SELECT d_ns || array_agg(u.ns), d_key || array_agg(u.key),
                       d_code || array_agg(CASE
                           WHEN t.key IS NOT NULL THEN 1
                           WHEN e.fingerprint IS NOT NULL AND u.fp IS NOT NULL
                                AND e.fingerprint <> u.fp THEN 3
                           ELSE 2 END::smallint)
                INTO d_ns, d_key, d_code
                FROM u
                JOIN {s}.dedupgate_records AS e ON e.namespace = u.ns AND e.key = u.key
                LEFT JOIN taken AS t ON t.namespace = u.ns AND t.key = u.key;
            END IF;
        END IF;

        EXIT WHEN array_length(d_ns, 1) IS NOT DISTINCT FROM v_n OR v_n = 0;
        SELECT array_agg(u.ns), array_agg(u.key), array_agg(u.ttl_ms), array_agg(u.fp),
               array_agg(u.result)
        INTO t_ns, t_key, t_ttl, t_fp, t_result
        FROM unnest(t_ns, t_key, t_ttl, t_fp, t_result) AS u(ns, key, ttl_ms, fp, result)
        WHERE NOT EXISTS (SELECT 1 FROM unnest(d_ns, d_key) AS d(ns, key)
                          WHERE d.ns = u.ns AND d.key = u.key);
    END LOOP;

    RETURN QUERY
    SELECT d.code, coalesce(f.state, r.state), coalesce(f.fence, r.fence), NULL::bytea,
           coalesce(f.fingerprint, r.fingerprint), coalesce(f.owner, r.owner),
           coalesce(f.created_at_ms, r.created_at_ms), coalesce(f.expires_at_ms, r.expires_at_ms),
           coalesce(f.lease_expires_at_ms, r.lease_expires_at_ms),
           coalesce(f.completed_at_ms, r.completed_at_ms), coalesce(f.result, r.result)
    FROM unnest(p_ns, p_key) WITH ORDINALITY AS u(ns, key, i)
    JOIN unnest(d_ns, d_key, d_code) AS d(ns, key, code) ON d.ns = u.ns AND d.key = u.key
    LEFT JOIN unnest(f_rows || a_rows) AS f
           ON d.code <> 3 AND f.namespace = u.ns AND f.key = u.key
    -- A subquery kept apart (OFFSET 0), so that the test on f gates its index probe instead of
    -- filtering the row the probe found: most rows of a batch of new keys are in a_rows.
    LEFT JOIN LATERAL (
        SELECT r.* FROM {s}.dedupgate_records AS r
        WHERE d.code <> 3 AND f.namespace IS NULL AND r.namespace = u.ns AND r.key = u.key
        OFFSET 0) AS r ON true
    ORDER BY u.i;
END
$$;

-- A batch: one call, one transaction, one commit. Ops run one by one, each through the same
-- function as a single op (each reading the clock once it holds its row), the keys in
-- (namespace, key) order and the ops of one key in array order, so a later op sees an earlier
-- one; a batch of claims only (or marks only), all of distinct keys, goes set-based through
-- dedupgate_claim_distinct (or dedupgate_mark_distinct). p_kind: 1 claim, 2 mark, 3 complete, 4 release, 5 extend,
-- 6 get, 7 forget. Unused fields of an op are NULL.
CREATE FUNCTION {s}.dedupgate_apply_batch(p_kind smallint[], p_ns bytea[], p_key bytea[],
                                          p_ttl_ms bigint[], p_lease_ms bigint[], p_fp bytea[],
                                          p_owner bytea[], p_token bytea[], p_result bytea[])
RETURNS SETOF {s}.dedupgate_answer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n       integer := coalesce(array_length(p_kind, 1), 0);
    i       integer;
    answers {s}.dedupgate_answer[] := '{}';
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
    -- The ops in (namespace, key) order, those of one key in array order, and the answers in
    -- array order: each op locks its row (or waits for another transaction's insert of it) as
    -- it comes, and in array order two batches over the same keys in different orders
    -- deadlocked. Ops on different keys never see each other, so the answers are the same.
    FOR i IN SELECT u.i FROM unnest(p_ns, p_key) WITH ORDINALITY AS u(ns, key, i)
             ORDER BY u.ns, u.key, u.i LOOP
        answers[i] := CASE p_kind[i]
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
    RETURN QUERY SELECT * FROM unnest(answers);
END
$$;

-- The bounded sweeper: removes at most p_batch_max expired rows, skipping rows another
-- transaction holds (a claim about to take one over), and returns how many went. It never waits
-- for a lock (SKIP LOCKED), so its clock read is not stale; a stale one would only make it
-- remove less.
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
