//! `dedupgate claim|complete|release|extend|mark|get|forget`: the API from the shell, against a
//! server (`--server URL`, through dedupgate-client with its safe retries) or a store directly
//! (`--store STORE`, through `dedupgate_core::Gate`). Both print the same JSON as the HTTP API's
//! success body on stdout and exit 0 (a duplicate is an answer, not an error; `claim -e` and
//! `mark -e` exit [`EXIT_DUPLICATE`] for one, opt-in so scripts that read the JSON under
//! `set -e` keep working). The gate's
//! refusal (`lease_lost`, `fingerprint_mismatch`, …, and `get` of an absent key) prints its code
//! and detail on stderr and exits 1; when the gate could not be asked or gave no answer
//! (`unavailable`, a server or store that cannot be reached or opened) the exit is
//! [`EXIT_NOT_DECIDED`], so a script never takes "could not ask" for "no record".
//!
//! `--server` keeps the client's typed calls rather than the server as an `http://` store: an
//! op leaves the server's own defaults out (`--ttl` and `--lease` say "[default: the
//! server's]", a [`ValidOp`] always holds a duration), and a refusal the core has no code for
//! (`forbidden`, `unauthorized`) is the gate's answer, exit 1, where the store says
//! `unavailable`.

use std::process::ExitCode;

use anyhow::Context;
#[cfg(feature = "http-client")]
use dedupgate_client::{Client, ClientError};
use dedupgate_core::{
    ClaimOptions, CompleteOptions, Defaults, Gate, GateError, KeySet, KeySetCall, MarkOptions,
    Namespace, Outcome, RecordId, Request, Store, Token, ValidOp,
};
use dedupgate_server::parse_duration_ms;
use serde_json::{json, Value};

use dedupgate_stores::{EmbeddedOptions, StoreSpec};

use crate::commands::pipeline::backend::open_waiting;

/// Exit code when the gate could not be asked or gave no answer (docs/cli.md).
pub const EXIT_NOT_DECIDED: u8 = 3;
/// Exit code of a usage error (clap's own).
const EXIT_USAGE: u8 = 2;
/// Exit code of `claim -e` and `mark -e` when the key is a duplicate (docs/cli.md).
pub const EXIT_DUPLICATE: u8 = 4;
use crate::commands::pipeline::keyspec::key_set_members;

/// Where the operation goes.
#[derive(clap::Args, Debug, Clone)]
pub struct Target {
    /// A running gate, e.g. http://127.0.0.1:7878.
    #[arg(long, env = "DEDUPGATE_SERVER", conflicts_with = "store")]
    server: Option<String>,
    /// A store opened directly (same STORE forms as `serve --store`).
    #[arg(long)]
    store: Option<String>,
    /// Bearer token for --server.
    #[arg(long, env = "DEDUPGATE_TOKEN", hide_env_values = true)]
    bearer_token: Option<String>,
    /// Namespace of the key.
    #[arg(long, short = 'n')]
    namespace: String,
    /// The dedup key.
    #[arg(long, short = 'k')]
    key: String,
    /// How long to wait for an embedded --store another process is using at that moment.
    #[arg(long, default_value = "30s", value_name = "D", value_parser = parse_duration_ms)]
    lock_wait: u64,
}

/// The API subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum ApiCommand {
    /// Claim a key under a lease (prints new with a token, or duplicate with the record).
    #[command(after_help = super::help::CLAIM)]
    Claim {
        #[command(flatten)]
        target: Target,
        /// Record retention, e.g. 24h [default: the server's].
        #[arg(long)]
        ttl: Option<String>,
        /// Lease, e.g. 30s [default: the server's].
        #[arg(long)]
        lease: Option<String>,
        /// Payload hash; a different one on an existing key is a mismatch.
        #[arg(long)]
        fingerprint: Option<String>,
        /// Claimer id; the same owner claiming again gets its claim back.
        #[arg(long)]
        owner: Option<String>,
        /// Exit 4 when the key is a duplicate (0 stays "new"), so a script can branch
        /// without reading the JSON.
        #[arg(short = 'e', long)]
        exit_status: bool,
    },
    /// Complete a claim, storing an optional JSON result.
    #[command(after_help = super::help::API)]
    Complete {
        #[command(flatten)]
        target: Target,
        /// The claim's token.
        #[arg(long)]
        token: String,
        /// JSON result replayed to duplicates.
        #[arg(long)]
        result: Option<String>,
        /// New retention from now.
        #[arg(long)]
        ttl: Option<String>,
    },
    /// Release a claim so the next claim runs again.
    #[command(after_help = super::help::API)]
    Release {
        #[command(flatten)]
        target: Target,
        /// The claim's token.
        #[arg(long)]
        token: String,
    },
    /// Renew a claim's lease.
    #[command(after_help = super::help::API)]
    Extend {
        #[command(flatten)]
        target: Target,
        /// The claim's token.
        #[arg(long)]
        token: String,
        /// New lease from now, e.g. 30s.
        #[arg(long)]
        lease: String,
    },
    /// Mark a key completed before processing (idempotent ordering).
    #[command(after_help = super::help::CLAIM)]
    Mark {
        #[command(flatten)]
        target: Target,
        /// Record retention [default: the server's].
        #[arg(long)]
        ttl: Option<String>,
        /// Payload hash.
        #[arg(long)]
        fingerprint: Option<String>,
        /// JSON result replayed to duplicates.
        #[arg(long)]
        result: Option<String>,
        /// Exit 4 when the key is a duplicate (0 stays "new"), so a script can branch
        /// without reading the JSON.
        #[arg(short = 'e', long)]
        exit_status: bool,
    },
    /// Print a key's record (exit 1 when there is none, 3 when the gate could not be asked).
    #[command(after_help = super::help::GET)]
    Get {
        #[command(flatten)]
        target: Target,
    },
    /// Delete a key's record (admin).
    #[command(after_help = super::help::API)]
    Forget {
        #[command(flatten)]
        target: Target,
    },
}

fn duration(flag: &str, v: &Option<String>) -> anyhow::Result<Option<u64>> {
    v.as_deref()
        .map(|s| parse_duration_ms(s).map_err(|e| anyhow::anyhow!("--{flag}: {e}")))
        .transpose()
}

fn json_arg(v: &Option<String>) -> anyhow::Result<Option<Value>> {
    v.as_deref()
        .map(|s| serde_json::from_str(s).context("--result must be JSON (quote strings: '\"ok\"')"))
        .transpose()
}

/// An operation with its flags parsed, ready for either target.
struct Call {
    target: Target,
    /// The operation, as the core reads a request before checking it.
    op: Request,
    /// `-e`: a duplicate exits [`EXIT_DUPLICATE`].
    exit_status: bool,
}

fn parse(cmd: ApiCommand) -> anyhow::Result<Call> {
    Ok(match cmd {
        ApiCommand::Claim {
            target,
            ttl,
            lease,
            fingerprint,
            owner,
            exit_status,
        } => Call {
            target,
            exit_status,
            op: Request::Claim(ClaimOptions {
                ttl_ms: duration("ttl", &ttl)?,
                lease_ms: duration("lease", &lease)?,
                fingerprint,
                owner,
            }),
        },
        ApiCommand::Complete {
            target,
            token,
            result,
            ttl,
        } => Call {
            target,
            exit_status: false,
            op: Request::Complete {
                token: Token::new(token),
                opts: CompleteOptions {
                    result: json_arg(&result)?,
                    ttl_ms: duration("ttl", &ttl)?,
                },
            },
        },
        ApiCommand::Release { target, token } => Call {
            target,
            exit_status: false,
            op: Request::Release {
                token: Token::new(token),
            },
        },
        ApiCommand::Extend {
            target,
            token,
            lease,
        } => Call {
            target,
            exit_status: false,
            op: Request::Extend {
                token: Token::new(token),
                lease_ms: parse_duration_ms(&lease).map_err(|e| anyhow::anyhow!("--lease: {e}"))?,
            },
        },
        ApiCommand::Mark {
            target,
            ttl,
            fingerprint,
            result,
            exit_status,
        } => Call {
            target,
            exit_status,
            op: Request::Mark(MarkOptions {
                ttl_ms: duration("ttl", &ttl)?,
                fingerprint,
                result: json_arg(&result)?,
            }),
        },
        ApiCommand::Get { target } => Call {
            target,
            exit_status: false,
            op: Request::Get,
        },
        ApiCommand::Forget { target } => Call {
            target,
            exit_status: false,
            op: Request::Forget,
        },
    })
}

/// Why an API call printed no answer: the gate's refusal (printed with its code), a failure
/// after part of the call took effect, or a failure before anything was known.
enum Failure {
    Answer {
        code: String,
        detail: String,
    },
    /// Something changed before the failure (exit 1, not "could not ask"): the detail says what.
    Partial {
        code: String,
        detail: String,
    },
    Other(anyhow::Error),
}

/// Runs one API subcommand.
pub fn run(cmd: ApiCommand) -> anyhow::Result<ExitCode> {
    // A bad flag value (a duration, a JSON result) is a usage error, like clap's own.
    let call = match parse(cmd) {
        Ok(call) => call,
        Err(e) => {
            eprintln!("dedupgate: {e:#}");
            return Ok(ExitCode::from(EXIT_USAGE));
        }
    };
    // Exactly one target, well-formed: anything else is a usage error, not "could not ask".
    let target = match (&call.target.server, &call.target.store) {
        #[cfg(feature = "http-client")]
        (Some(url), None) => Client::new(url).map(To::Server).map_err(|e| e.to_string()),
        // A well-formed call this build cannot make: "could not ask", as an `http://` --store
        // that this build cannot open (docs/cli.md), not a usage error.
        #[cfg(not(feature = "http-client"))]
        (Some(_), None) => {
            eprintln!("dedupgate: --server needs dedupgate built with the \"http-client\" feature");
            return Ok(ExitCode::from(EXIT_NOT_DECIDED));
        }
        (None, Some(spec)) => spec
            .parse()
            .map(To::Store)
            .map_err(|e: dedupgate_stores::SpecError| e.to_string()),
        _ => Err("give --server URL (or DEDUPGATE_SERVER) or --store STORE".to_owned()),
    };
    let target = match target {
        Ok(target) => target,
        Err(why) => {
            eprintln!("dedupgate: {why}");
            return Ok(ExitCode::from(EXIT_USAGE));
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let answer = runtime.block_on(async {
        match target {
            #[cfg(feature = "http-client")]
            To::Server(client) => via_server(client, &call).await,
            To::Store(spec) => via_store(spec, &call).await,
        }
    });
    match answer {
        Ok(value) => {
            crate::commands::print_line(&value)?;
            Ok(if call.exit_status && value["outcome"] == "duplicate" {
                ExitCode::from(EXIT_DUPLICATE)
            } else {
                ExitCode::SUCCESS
            })
        }
        Err(Failure::Answer { code, detail }) => {
            eprintln!("dedupgate: {code}: {detail}");
            // The wire code of a store that could not decide (API.md).
            Ok(if code == "unavailable" {
                ExitCode::from(EXIT_NOT_DECIDED)
            } else {
                ExitCode::FAILURE
            })
        }
        Err(Failure::Partial { code, detail }) => {
            eprintln!("dedupgate: {code}: {detail}");
            Ok(ExitCode::FAILURE)
        }
        Err(Failure::Other(e)) => {
            eprintln!("dedupgate: {e:#}");
            Ok(ExitCode::from(EXIT_NOT_DECIDED))
        }
    }
}

#[cfg(feature = "http-client")]
fn from_client(e: ClientError) -> Failure {
    match e {
        ClientError::Gate(g) => from_gate(g),
        ClientError::Rejected(p) => Failure::Answer {
            code: p.code,
            detail: p.detail,
        },
        other => Failure::Other(anyhow::Error::new(other)),
    }
}

fn from_gate(e: GateError) -> Failure {
    let code = e.code();
    let detail = match &e {
        // The client's wrapping of a server's detail: the detail alone says it.
        GateError::Invalid(invalid) if invalid.field == "request" => invalid.reason.clone(),
        _ => e.to_string(),
    };
    Failure::Answer {
        code: code.to_owned(),
        detail: without_code(code, &detail).to_owned(),
    }
}

/// `detail` without a first part that restates `code` in words ("invalid request: …",
/// "store unavailable: …"), since the message prints the code before it.
fn without_code<'a>(code: &str, detail: &'a str) -> &'a str {
    let words = code.replace('_', " ");
    match detail.split_once(": ") {
        Some((head, rest)) if head.ends_with(words.as_str()) => rest,
        _ => detail,
    }
}

fn not_found() -> Failure {
    Failure::Answer {
        code: "not_found".into(),
        detail: "no live record for this key".into(),
    }
}

fn to_json<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).expect("core types serialize")
}

/// Where a call goes, parsed from `--server` or `--store`.
enum To {
    #[cfg(feature = "http-client")]
    Server(Client),
    Store(StoreSpec),
}

#[cfg(feature = "http-client")]
async fn via_server(mut client: Client, call: &Call) -> Result<Value, Failure> {
    if let Some(t) = &call.target.bearer_token {
        client = client.with_bearer(t);
    }
    let (ns, key) = (call.target.namespace.as_str(), call.target.key.as_str());
    Ok(match &call.op {
        Request::Claim(opts) => to_json(
            &client
                .claim(ns, key, opts.clone())
                .await
                .map_err(from_client)?,
        ),
        Request::Complete { token, opts } => {
            let record = client
                .complete(ns, key, token, opts.result.clone(), opts.ttl_ms)
                .await
                .map_err(from_client)?;
            json!({ "record": record })
        }
        Request::Release { token } => {
            client.release(ns, key, token).await.map_err(from_client)?;
            json!({"released": true})
        }
        Request::Extend { token, lease_ms } => {
            let at = client
                .extend(ns, key, token, *lease_ms)
                .await
                .map_err(from_client)?;
            json!({ "lease_expires_at_ms": at })
        }
        Request::Mark(opts) => {
            let opts = dedupgate_client::MarkOptions {
                ttl_ms: opts.ttl_ms,
                fingerprint: opts.fingerprint.clone(),
                result: opts.result.clone(),
            };
            to_json(&client.mark(ns, key, opts).await.map_err(from_client)?)
        }
        Request::Get => match client.get(ns, key).await.map_err(from_client)? {
            Some(record) => to_json(&record),
            None => return Err(not_found()),
        },
        Request::Forget => json!({"deleted": client.forget(ns, key).await.map_err(from_client)?}),
    })
}

async fn via_store(spec: StoreSpec, call: &Call) -> Result<Value, Failure> {
    let (store, key_set) = open_waiting(&spec, call.target.lock_wait, &EmbeddedOptions::default())
        .await
        .map_err(Failure::Other)?;
    if let (Request::Forget, Some(key_set)) = (&call.op, key_set) {
        return forget_with_key_set(store, key_set.as_ref(), call).await;
    }
    let (ns, key) = (call.target.namespace.as_str(), call.target.key.as_str());
    let id = RecordId::new(ns, key).map_err(|e| from_gate(e.into()))?;
    // The builders make every check and fill the defaults, as Gate's own calls do.
    let op = ValidOp::from_request(call.op.clone(), Defaults::default())
        .map_err(|e| from_gate(e.into()))?;
    Ok(match store.apply(id, op).await.map_err(from_gate)? {
        Outcome::Claimed(claim) => to_json(&claim),
        Outcome::Completed(record) => json!({ "record": record }),
        Outcome::Released => json!({"released": true}),
        Outcome::Extended {
            lease_expires_at_ms,
        } => json!({ "lease_expires_at_ms": lease_expires_at_ms }),
        Outcome::Marked(mark) => to_json(&mark),
        Outcome::Found(Some(record)) => to_json(&record),
        Outcome::Found(None) => return Err(not_found()),
        Outcome::Forgotten(deleted) => json!({ "deleted": deleted }),
    })
}

/// `forget` on a store that keeps a key set (an embedded store): the key's gate record and, when
/// a `dedup --ledger` keeps the key in the store's key set, its member too, so the next
/// sighting of the key is new whichever of them remembered it.
///
/// Two commits, the key set's first (its call fails before writing anything when a member
/// cannot be read), then the gate record's. Each is idempotent, so a command that fails
/// between them (the error says so) is simply run again.
async fn forget_with_key_set(
    store: std::sync::Arc<dyn Store>,
    key_set: &dyn KeySet,
    call: &Call,
) -> Result<Value, Failure> {
    let (ns, key) = (call.target.namespace.as_str(), call.target.key.as_str());
    let forget = KeySetCall {
        namespace: Namespace::new(ns).map_err(|e| from_gate(e.into()))?,
        record: Vec::new(),
        check: Vec::new(),
        record_new: false,
        gate_keys: Vec::new(),
        ttl_ms: 1,
        forget: key_set_members(key),
    };
    let member = key_set
        .key_set(forget)
        .await
        .map_err(from_gate)?
        .contains(&true);
    let gate = Gate::from_arc(store);
    let record = gate.forget(ns, key).await.map_err(|e| {
        if member {
            Failure::Partial {
                code: e.code().to_owned(),
                detail: format!(
                    "{e} (its key-set member was removed, its gate record was not: run forget \
                     again)"
                ),
            }
        } else {
            from_gate(e)
        }
    })?;
    Ok(json!({"deleted": record || member}))
}
