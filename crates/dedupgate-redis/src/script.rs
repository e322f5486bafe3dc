//! Script calls: a group's ops chunked into `EVALSHA` calls sent in one pipeline, the script
//! reloaded once if the server lost it, `WAIT` after writes, and each call's reply decoded.

use dedupgate_core::{GateError, Outcome, StoreError};
use redis::{Cmd, Value};

use crate::reply::{decode, number, server_error};
use crate::store::{Inner, Prepared, DECIDE_LUA};

impl Inner {
    /// Sends one pipeline of script calls (all in one slot on a cluster, `guard` one of their
    /// keys: see [`Conn::start_pipeline`](crate::conn::Conn::start_pipeline)), reloading the
    /// script once if the server lost it, then `WAIT`s if asked. One answer per call.
    pub(crate) async fn send(
        &self,
        calls: Vec<Cmd>,
        writes: bool,
        guard: &[u8],
    ) -> Vec<Result<Value, StoreError>> {
        let wait = writes && self.opts.wait_replicas > 0;
        let n = calls.len();
        let mut answers: Vec<Option<Result<Value, StoreError>>> = (0..n).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..n).collect();
        let mut wait_acked: Option<i64> = None;
        for attempt in 0..2 {
            let (mut pipe, offset) =
                self.conn
                    .start_pipeline(pending.len() + 2, pending.len(), guard);
            if attempt > 0 {
                pipe.cmd("SCRIPT").arg("LOAD").arg(DECIDE_LUA);
            }
            let skip = usize::from(attempt > 0);
            for &i in &pending {
                pipe.add_command(calls[i].clone());
            }
            if wait {
                pipe.cmd("WAIT")
                    .arg(self.opts.wait_replicas)
                    .arg(self.opts.wait_timeout_ms);
            }
            let count = skip + pending.len() + usize::from(wait);
            let values = match self.conn.pipeline(&pipe, offset, count).await {
                Ok(values) if values.len() == count => values,
                Ok(values) => {
                    let why = format!(
                        "redis answered {} replies to a pipeline of {count}",
                        values.len()
                    );
                    return fail_all(answers, &why);
                }
                Err(e) if is_noscript(&e) && attempt == 0 => {
                    continue; // every call of the pipeline missed the script: reload and resend
                }
                Err(e) => return fail_all(answers, &e.to_string()),
            };
            let mut values = values.into_iter().skip(skip);
            let mut missed = Vec::new();
            for &i in &pending {
                let v = values.next().unwrap_or(Value::Nil);
                match v {
                    Value::ServerError(e) if e.code() == "NOSCRIPT" && attempt == 0 => {
                        missed.push(i);
                    }
                    other => answers[i] = Some(Ok(other)),
                }
            }
            if wait {
                wait_acked = match values.next() {
                    Some(Value::Int(acked)) => Some(acked),
                    _ => Some(-1),
                };
            }
            pending = missed;
            if pending.is_empty() {
                break;
            }
        }
        if let Some(acked) = wait_acked {
            if acked < i64::from(self.opts.wait_replicas) {
                let why = format!(
                    "only {} of {} replicas acknowledged the write within {} ms (WAIT)",
                    acked.max(0),
                    self.opts.wait_replicas,
                    self.opts.wait_timeout_ms
                );
                return fail_all(answers, &why);
            }
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(StoreError::Unavailable("no reply".to_owned()))))
            .collect()
    }

    /// Decides one run of prepared ops that share a connection (all ops on one server, or one
    /// slot on a cluster): chunks them into script calls, sends them in one pipeline.
    pub(crate) async fn run_group(
        &self,
        group: Vec<Prepared>,
    ) -> Vec<(usize, Result<Outcome, GateError>)> {
        let writes = group.iter().any(|p| p.op.writes());
        let chunks: Vec<&[Prepared]> = group.chunks(self.opts.script_ops_max).collect();
        let calls: Vec<Cmd> = chunks.iter().map(|chunk| self.eval_cmd(chunk)).collect();
        let guard = group.first().map_or(&[][..], |p| &p.keys.record[..]);
        let answers = self.send(calls, writes, guard).await;
        let mut out = Vec::with_capacity(group.len());
        for (chunk, answer) in chunks.into_iter().zip(answers) {
            match answer.and_then(|v| match v {
                Value::Array(items) if items.len() == chunk.len() + 1 => Ok(items),
                Value::ServerError(e) => Err(server_error(e)),
                other => Err(StoreError::Corrupt(format!(
                    "unexpected script reply {other:?}"
                ))),
            }) {
                Ok(items) => {
                    let mut items = items.into_iter();
                    let now = items.next().as_ref().and_then(number);
                    for (p, item) in chunk.iter().zip(items) {
                        out.push((p.index, decode(p, now, item)));
                    }
                }
                Err(e) => {
                    for p in chunk {
                        let err = match &e {
                            StoreError::Corrupt(why) => StoreError::Corrupt(why.clone()),
                            StoreError::Unavailable(why) => StoreError::Unavailable(why.clone()),
                            other => StoreError::Unavailable(other.to_string()),
                        };
                        out.push((p.index, Err(GateError::Store(err))));
                    }
                }
            }
        }
        out
    }
}

/// Every call of a pipeline answered `unavailable` for the same reason.
fn fail_all(
    answers: Vec<Option<Result<Value, StoreError>>>,
    why: &str,
) -> Vec<Result<Value, StoreError>> {
    answers
        .into_iter()
        .map(|_| Err(StoreError::Unavailable(why.to_owned())))
        .collect()
}

fn is_noscript(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}
