//! The decision script's arguments: the record keys, each op's code and arguments (runs of
//! plain claims packed together), and the fresh token drawn for each call.

use dedupgate_core::{Op, Token};
use redis::Cmd;

use crate::store::{Inner, Prepared};

/// A claim's, mark's or release's token drawn for this call: a claim keeps it only if it
/// creates a claim, a mark keeps it hidden in the record it creates, a release in the
/// tombstone it leaves. Fresh per call, so a call that finds its own token was sent twice (a
/// cluster client resends a pipeline after a lost connection or a redirect) and is answered as
/// its first run was: never as a duplicate of itself, and a release never as `lease_lost`.
pub(crate) fn call_token(op: &Op) -> Option<Token> {
    matches!(op, Op::Claim { .. } | Op::Mark { .. } | Op::Release { .. }).then(Token::generate)
}

impl Inner {
    pub(crate) fn eval_cmd(&self, chunk: &[Prepared]) -> Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.script.get_hash()).arg(chunk.len());
        for p in chunk {
            cmd.arg(&p.keys.record[..]);
        }
        cmd.arg(self.opts.fence_keep_ms);
        let mut rest = chunk;
        while let Some(first) = rest.first() {
            // Consecutive plain claims with one ttl and lease go as one run: 'c' ttl lease n
            // and n tokens.
            if let Some(times) = plain_claim(&first.op) {
                let n = rest
                    .iter()
                    .take_while(|p| plain_claim(&p.op) == Some(times))
                    .count();
                cmd.arg("c").arg(times.0).arg(times.1).arg(n);
                for p in &rest[..n] {
                    cmd.arg(p.token.as_ref().map_or("", Token::as_str));
                }
                rest = &rest[n..];
            } else {
                push_op_args(&mut cmd, &first.op, first.token.as_ref());
                rest = &rest[1..];
            }
        }
        cmd
    }
}

/// A claim without fingerprint or owner: its ttl and lease.
fn plain_claim(op: &Op) -> Option<(u64, u64)> {
    match op {
        Op::Claim {
            ttl_ms,
            lease_ms,
            fingerprint: None,
            owner: None,
        } => Some((*ttl_ms, *lease_ms)),
        _ => None,
    }
}

/// Pushes a non-plain op's code and its arguments (see `decide.lua`; '' stands for none). `token` is a
/// claim's, mark's or release's token for this call ([`call_token`]).
fn push_op_args(cmd: &mut Cmd, op: &Op, token: Option<&Token>) {
    fn opt(s: &Option<String>) -> &str {
        s.as_deref().unwrap_or("")
    }
    let json =
        |v: &Option<serde_json::Value>| v.as_ref().map(|v| v.to_string()).unwrap_or_default();
    let fresh = token.map_or("", Token::as_str);
    match op {
        Op::Claim {
            ttl_ms,
            lease_ms,
            fingerprint,
            owner,
        } => {
            cmd.arg("C")
                .arg(*ttl_ms)
                .arg(*lease_ms)
                .arg(opt(fingerprint))
                .arg(opt(owner))
                .arg(fresh);
        }
        Op::Mark {
            ttl_ms,
            fingerprint,
            result,
        } => {
            cmd.arg("M")
                .arg(*ttl_ms)
                .arg(opt(fingerprint))
                .arg(json(result))
                .arg(fresh);
        }
        Op::Complete {
            token,
            result,
            ttl_ms,
        } => {
            cmd.arg("K")
                .arg(token.as_str())
                .arg(json(result))
                .arg(ttl_ms.map(|t| t.to_string()).unwrap_or_default());
        }
        Op::Release { token } => {
            cmd.arg("R").arg(token.as_str()).arg(fresh);
        }
        Op::Extend { token, lease_ms } => {
            cmd.arg("X").arg(token.as_str()).arg(*lease_ms);
        }
        Op::Get => {
            cmd.arg("G");
        }
        Op::Forget => {
            cmd.arg("F");
        }
    }
}
