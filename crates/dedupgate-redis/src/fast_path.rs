//! The batch fast path: the claims and marks of new keys in a large batch written with a native
//! `SET … NX GET` of the record the script would write, on one `TIME` read for the batch.

use std::collections::HashMap;

use dedupgate_core::{GateError, Op, Outcome, StoreError};
use futures::stream::{self, StreamExt};
use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use redis::{Cmd, Value};

use crate::cluster::{by_slot, CLUSTER_GROUPS_IN_FLIGHT_MAX};
use crate::conn::Conn;
use crate::record::{decide_absent, encode_entry};
use crate::reply::{server_error, time_ms};
use crate::store::{Inner, Prepared};

/// Fewest claims and marks of fresh-looking keys in one `apply_batch` for which the native
/// fast path (see [`Inner::decide_fast`]) is tried: it costs one more round trip (`TIME`), which
/// a few keys do not pay back.
pub(crate) const FAST_PATH_OPS_MIN: usize = 16;

/// Largest spread between the clocks of a cluster's masters (their `TIME` replies to one
/// request) at which the fast path still takes the earliest of them as the batch's time;
/// beyond it the batch goes through the script, which reads each node's own clock.
const CLUSTER_CLOCK_SPREAD_MAX_MS: u64 = 250;

impl Inner {
    /// Whether the options leave room for the fast path's clock argument (see
    /// [`Inner::set_fresh`]): an answered fast path takes at most two response timeouts (the
    /// `TIME`, then the pipeline), which must stay well inside `fence_keep_ms`. With a shorter
    /// keep every op goes through the script.
    pub(crate) fn fast_path_allowed(&self) -> bool {
        self.opts.fence_keep_ms > self.opts.response_timeout_ms.saturating_mul(2)
    }

    /// The batch path for many claims and marks of new keys. Inside the script a new key costs
    /// Redis a `redis.call` from Lua besides the `SET` itself; sent natively, the same `SET`
    /// costs Redis about a third less CPU (`docs/benchmarks-redis.md`). So:
    ///
    /// 1. one `TIME` (Redis's clock, never the gate's) for the batch;
    /// 2. per claim or mark whose record appears once in the batch, a native
    ///    `SET key <record> NX GET PXAT <expiry + keep>` in one pipeline (per slot on a
    ///    cluster), where `<record>` is the entry `decide` stores for a new claim or mark at
    ///    that time, byte for byte as `decide.lua` writes it. A nil reply means the key did not
    ///    exist: the op is decided, with `decide`'s answer (the script's short replies `1` and
    ///    `2` answer the same);
    /// 3. an op whose `SET` found a value (a live, expired or released record) goes through the
    ///    script afterwards, which decides afresh on the record as it is then. Each op thus still
    ///    takes effect in one atomic step: the `SET NX` that created its record, or its script
    ///    call.
    ///
    /// Every other op (complete, release, extend, get, forget, and every op of a record that
    /// appears more than once in the batch, so that its ops keep their order) goes through the
    /// script, concurrently with steps 1-2: they touch other records.
    pub(crate) async fn decide_fast(
        &self,
        prepared: Vec<Prepared>,
    ) -> Vec<(usize, Result<Outcome, GateError>)> {
        let mut per_record: HashMap<&[u8], usize> = HashMap::with_capacity(prepared.len());
        for p in &prepared {
            *per_record.entry(&p.keys.record[..]).or_default() += 1;
        }
        let fresh_candidate: Vec<bool> = prepared
            .iter()
            .map(|p| {
                matches!(*p.op, Op::Claim { .. } | Op::Mark { .. })
                    && per_record[&p.keys.record[..]] == 1
            })
            .collect();
        drop(per_record);
        if fresh_candidate.iter().filter(|&&c| c).count() < FAST_PATH_OPS_MIN {
            return self.decide_script(prepared).await;
        }
        let (mut fresh, mut rest) = (Vec::new(), Vec::new());
        for (p, candidate) in prepared.into_iter().zip(fresh_candidate) {
            if candidate {
                fresh.push(p);
            } else {
                rest.push(p);
            }
        }
        let ((mut decided, found), others) =
            futures::join!(self.claim_fresh(fresh), self.decide_script(rest));
        decided.extend(others);
        decided.extend(self.decide_script(found).await);
        decided
    }

    /// Steps 1-2 of [`Inner::decide_fast`]: the ops decided by a native `SET`, and the ops
    /// whose key existed (for the script). When Redis's time cannot be read (or a cluster's
    /// masters disagree on it), every op goes to the script.
    pub(crate) async fn claim_fresh(
        &self,
        fresh: Vec<Prepared>,
    ) -> (Vec<(usize, Result<Outcome, GateError>)>, Vec<Prepared>) {
        let now_ms = match self.redis_time_ms().await {
            Ok(now_ms) => now_ms,
            Err(why) => {
                tracing::debug!("redis batch fast path skipped: {why}");
                return (Vec::new(), fresh);
            }
        };
        let groups = match &self.conn {
            Conn::Single(_) => vec![fresh],
            Conn::Cluster(_) => by_slot(fresh),
        };
        let mut decided = Vec::new();
        let mut found = Vec::new();
        let mut results = stream::iter(groups)
            .map(|group| self.set_fresh(group, now_ms))
            .buffer_unordered(CLUSTER_GROUPS_IN_FLIGHT_MAX);
        while let Some((d, f)) = results.next().await {
            decided.extend(d);
            found.extend(f);
        }
        found.sort_by_key(|p| p.index);
        (decided, found)
    }

    /// Redis's time in ms: `TIME` on the server, or on a cluster the earliest of the masters'
    /// clocks (each node judges expiry on its own; see [`Inner::set_fresh`] for why the earliest
    /// is safe), refused when they spread by more than [`CLUSTER_CLOCK_SPREAD_MAX_MS`].
    pub(crate) async fn redis_time_ms(&self) -> Result<u64, String> {
        let cmd = redis::cmd("TIME");
        match &self.conn {
            Conn::Single(h) => {
                let v = h.command(&cmd).await.map_err(|e| e.to_string())?;
                time_ms(&v).ok_or_else(|| format!("unexpected TIME reply {v:?}"))
            }
            Conn::Cluster(h) => {
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None));
                let v = h
                    .current()
                    .route_command(cmd, routing)
                    .await
                    .map_err(|e| e.to_string())?;
                let Value::Map(per_node) = &v else {
                    return Err(format!("unexpected TIME reply {v:?}"));
                };
                let times = per_node
                    .iter()
                    .map(|(_, t)| time_ms(t))
                    .collect::<Option<Vec<u64>>>()
                    .ok_or_else(|| format!("unexpected TIME reply {v:?}"))?;
                let (Some(&min), Some(&max)) = (times.iter().min(), times.iter().max()) else {
                    return Err("no master answered TIME".to_owned());
                };
                if max - min > CLUSTER_CLOCK_SPREAD_MAX_MS {
                    return Err(format!(
                        "the masters' clocks spread by {} ms (more than {CLUSTER_CLOCK_SPREAD_MAX_MS})",
                        max - min
                    ));
                }
                Ok(min)
            }
        }
    }

    /// Step 2 of [`Inner::decide_fast`] for one group (one server, or one slot): one pipeline
    /// of `SET key <record> NX GET PXAT …` per op, then `TIME`, then `WAIT` when replicas are
    /// asked for. Returns the decided ops and the ops whose key existed.
    ///
    /// Why a time read one round trip before the `SET` is safe. The `SET` runs at the instant
    /// `t1` on Redis's clock and finds the key absent; the op is decided as the script would
    /// decide it at the earlier instant `t0 = now_ms`:
    ///
    /// - Fences. A record's key lives until `keep` ms after the record's expiry `e`, and `e` is
    ///   at least 1 ms after the millisecond its fence was issued in (a fence is at most that
    ///   millisecond times 1000 plus 999, the design's "fewer than 1000 claims of one key per
    ///   ms"). A key absent at `t1` therefore last held a record with `e + keep < t1`. If
    ///   `t1 - t0 < keep`, then `e < t0`, and every fence that key ever held is below
    ///   `t0 * 1000`, the new fence. The trailing `TIME` (`t_end`, run after every `SET` of the
    ///   pipeline on the same node) checks `t_end - t0 < keep`, which implies `t1 - t0 < keep`.
    ///   Should it fail (a clock stepped forward by about `keep` within the round trip, or a
    ///   cluster node far ahead of the earliest master), the new ops are answered `unavailable`
    ///   (their outcome unknown, as after a timeout or a failed `WAIT`), never with a fence that
    ///   might not increase. If the clock stepped back instead, `t1 < t0` and the bound holds
    ///   anyway. On a cluster `t0` is the earliest master's clock, never later than the key's
    ///   own node's reading: the bound only gets stronger, and the `t_end` check covers the skew.
    ///   [`Inner::fast_path_allowed`] keeps `keep` above two response timeouts, so an answered
    ///   round trip never trips the check unless a clock jumped.
    /// - State. The key held no live record at `t0` either (`e < t0`), and none was written
    ///   between `t0` and `t1` (its key would still exist at `t1`), so "absent" held over the
    ///   whole interval and the decision is the script's decision at `t0`: created, lease and
    ///   expiry times from `t0`, an instant within the caller's call.
    pub(crate) async fn set_fresh(
        &self,
        group: Vec<Prepared>,
        now_ms: u64,
    ) -> (Vec<(usize, Result<Outcome, GateError>)>, Vec<Prepared>) {
        let keep = self.opts.fence_keep_ms;
        let wait = self.opts.wait_replicas > 0;
        // Sized up front: growing each command's buffer argument by argument was a visible
        // share of the client's CPU per key.
        let guard = group.first().map_or(&[][..], |p| &p.keys.record[..]);
        let (mut pipe, offset) = self
            .conn
            .start_pipeline(group.len() + 2, group.len(), guard);
        let mut record = Vec::new();
        let mut sent = Vec::with_capacity(group.len());
        let mut answers = Vec::with_capacity(group.len());
        let mut found = Vec::new();
        for p in group {
            match fresh_record(&p, now_ms, &mut record) {
                Some((expires_at_ms, answer)) => {
                    let key = &p.keys.record[..];
                    // SET, NX, GET, PXAT and the 13-digit time: under 64 bytes.
                    let mut cmd = Cmd::with_capacity(7, key.len() + record.len() + 64);
                    cmd.arg("SET")
                        .arg(key)
                        .arg(&record[..])
                        .arg("NX")
                        .arg("GET")
                        .arg("PXAT")
                        .arg(expires_at_ms + keep);
                    pipe.add_command(cmd);
                    sent.push(p);
                    answers.push(answer);
                }
                None => found.push(p),
            }
        }
        if sent.is_empty() {
            return (Vec::new(), found);
        }
        pipe.cmd("TIME");
        if wait {
            pipe.cmd("WAIT")
                .arg(self.opts.wait_replicas)
                .arg(self.opts.wait_timeout_ms);
        }
        let count = sent.len() + 1 + usize::from(wait);
        let unavailable =
            |ops: Vec<Prepared>, why: &str| -> Vec<(usize, Result<Outcome, GateError>)> {
                ops.into_iter()
                    .map(|p| {
                        let err = StoreError::Unavailable(why.to_owned());
                        (p.index, Err(GateError::Store(err)))
                    })
                    .collect()
            };
        let values = match self.conn.pipeline(&pipe, offset, count).await {
            Ok(values) if values.len() == count => values,
            Ok(values) => {
                let why = format!(
                    "redis answered {} replies to a pipeline of {count}",
                    values.len()
                );
                return (unavailable(sent, &why), found);
            }
            Err(e) => return (unavailable(sent, &e.to_string()), found),
        };
        let mut values = values.into_iter();
        let mut decided = Vec::new();
        let mut created = Vec::new();
        for (p, answer) in sent.into_iter().zip(answers) {
            match values.next().unwrap_or(Value::Nil) {
                Value::Nil => created.push((p, answer)),
                Value::BulkString(_) => found.push(p),
                Value::ServerError(e) => {
                    decided.push((p.index, Err(GateError::Store(server_error(e)))));
                }
                other => {
                    let why = format!("unexpected SET reply {other:?}");
                    decided.push((p.index, Err(GateError::Store(StoreError::Corrupt(why)))));
                }
            }
        }
        let end_ms = values.next().as_ref().and_then(time_ms);
        let wait_acked = if wait {
            match values.next() {
                Some(Value::Int(acked)) => Some(acked),
                _ => Some(-1),
            }
        } else {
            None
        };
        let late = match end_ms {
            Some(end_ms) => end_ms.saturating_sub(now_ms) >= keep,
            None => true,
        };
        if late && !created.is_empty() {
            let why = format!(
                "redis's clock moved {} ms during a batch (fence_keep_ms {keep}): the outcome of \
                 its new keys is unknown",
                end_ms.map_or("?".to_owned(), |e| e.saturating_sub(now_ms).to_string())
            );
            tracing::warn!("{why}");
            decided.extend(unavailable(
                created.into_iter().map(|(p, _)| p).collect(),
                &why,
            ));
            return (decided, found);
        }
        if let Some(acked) = wait_acked {
            if acked < i64::from(self.opts.wait_replicas) && !created.is_empty() {
                let why = format!(
                    "only {} of {} replicas acknowledged the write within {} ms (WAIT)",
                    acked.max(0),
                    self.opts.wait_replicas,
                    self.opts.wait_timeout_ms
                );
                decided.extend(unavailable(
                    created.into_iter().map(|(p, _)| p).collect(),
                    &why,
                ));
                return (decided, found);
            }
        }
        // The SET found no key: the op is decided as `decide` decided it at `now_ms`.
        for (p, answer) in created {
            decided.push((p.index, Ok(answer)));
        }
        (decided, found)
    }
}

/// Writes to `out` the record the script writes for a new claim or mark of a key that does not
/// exist, decided at `now_ms` ([`decide_absent`]), byte for byte ([`encode_entry`]); returns
/// its `expires_at_ms` and the answer, or `None` for other ops.
fn fresh_record(p: &Prepared, now_ms: u64, out: &mut Vec<u8>) -> Option<(u64, Outcome)> {
    let (entry, answer) = decide_absent(p, now_ms)?;
    encode_entry(&entry, out);
    Some((entry.expires_at_ms, answer))
}
