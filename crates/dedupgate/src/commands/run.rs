//! `dedupgate run --key KEY -- CMD ARGS…`: the cron gate. Runs CMD at most once per key within
//! the ttl, whatever the number of triggers (overlapping cron runs, retries, several hosts on
//! one shared store).
//!
//! - `--mode retriable` (default): claim with a lease, renew the lease every third of its length
//!   while CMD runs, complete with CMD's exit status and the tail of its output when it exits 0,
//!   release when it fails so the next trigger runs it again. If `run` itself is killed (even
//!   with SIGKILL) the lease runs out and a later trigger takes over.
//! - `--mode idempotent`: mark the key before running; CMD runs at most once, even if it fails.
//! - A trigger that finds the key held exits at once saying who holds it and until when, or
//!   waits with `--wait`; one that finds it completed says when it ran.
//! - Signals sent to `run` (TERM, HUP, USR1, USR2; INT and QUIT too when stdin is not a
//!   terminal, since a terminal already delivers those to CMD) are passed on to CMD.
//!
//! Exit codes: CMD's own when it ran (128+N when a signal N ended it); 128+N too when signal N
//! stopped `run` before CMD started (the key given back); 0 when skipped (or
//! `--skip-exit-code N`); 125 when the gate failed (store unreachable, bad key, completion not
//! recorded); 126 when CMD could not be executed; 127 when CMD was not found; 2 for bad usage.

use std::ffi::OsString;
use std::hash::BuildHasher;
use std::io::IsTerminal;
use std::process::{ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use dedupgate_core::keys::{format_rfc3339_ms, parse_duration_ms, KeyTemplate};
use dedupgate_core::{Claim, ClaimOptions, Mark, Record, RecordId, State, Token};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::signal::unix::{signal, SignalKind};

use super::pipeline::backend::{is_lease_lost, Backend};
use super::pipeline::now_ms;
use dedupgate_stores::StoreSpec;

/// Exit code when the gate itself failed.
pub const EXIT_GATE_FAILED: u8 = 125;
/// Exit code when CMD exists but could not be executed.
pub const EXIT_CANNOT_EXECUTE: u8 = 126;
/// Exit code when CMD was not found.
pub const EXIT_NOT_FOUND: u8 = 127;
/// Bytes of CMD's stdout and of its stderr kept as the stored result's tail.
pub const OUTPUT_TAIL_BYTES: usize = 2048;
/// How long output copying may go on after CMD exited (a background grandchild may hold
/// the pipes open forever).
const OUTPUT_DRAIN_MS: u64 = 1000;
/// Longest pause between two tries of `--wait`.
const WAIT_POLL_MS_MAX: u64 = 1000;

/// Which ordering `run` uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RunMode {
    /// Claim, run, complete on success, release on failure (the next trigger retries).
    Retriable,
    /// Mark, then run: never run twice, even after a failure.
    Idempotent,
}

/// Flags of `dedupgate run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The key; may hold `{now|window:D}`, e.g. 'backup_{now|window:1d}' for one run per day.
    #[arg(long, value_name = "KEY")]
    key: String,
    /// How long a completed run blocks the key (500ms, 30s, 5m, 24h, 7d).
    #[arg(long, default_value = "24h", value_name = "D")]
    ttl: String,
    /// Lease of a retriable claim; renewed while CMD runs, so it bounds only how long a killed
    /// `run` blocks the key.
    #[arg(long, default_value = "30s", value_name = "D")]
    lease: String,
    /// retriable (default) or idempotent.
    #[arg(long, value_enum, default_value_t = RunMode::Retriable)]
    mode: RunMode,
    /// Namespace of the key.
    #[arg(long, default_value = "run", value_name = "NS")]
    namespace: String,
    /// Where records live: a path or embedded:PATH, memory:, redis://…, postgres://…,
    /// tiered:FAST,DURABLE [default: ./dedupgate-data].
    #[arg(long, value_name = "STORE", env = "DEDUPGATE_STORE")]
    store: Option<String>,
    /// Use the dedupgate server at URL instead of a store.
    #[arg(
        long,
        value_name = "URL",
        env = "DEDUPGATE_SERVER",
        conflicts_with = "store"
    )]
    server: Option<String>,
    /// If another run holds the key, wait for it (then run if it failed, skip if it completed).
    #[arg(long)]
    wait: bool,
    /// Longest --wait; after it the run is skipped [default: no limit].
    #[arg(long, value_name = "D", requires = "wait")]
    wait_timeout: Option<String>,
    /// Exit code when skipped as a duplicate.
    #[arg(long, default_value_t = 0, value_name = "N")]
    skip_exit_code: u8,
    /// Let CMD write straight to the terminal (no output tail is stored).
    #[arg(long)]
    no_capture: bool,
    /// How long to wait for an embedded store another process is using at that moment.
    #[arg(long, default_value = "30s", value_name = "D")]
    lock_wait: String,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// Runs `dedupgate run`.
pub fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dedupgate run: starting the runtime: {e}");
            return Ok(ExitCode::from(EXIT_GATE_FAILED));
        }
    };
    Ok(rt.block_on(async move {
        match gate_and_run(args).await {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("dedupgate run: {e:#}");
                ExitCode::from(EXIT_GATE_FAILED)
            }
        }
    }))
}

/// Parsed settings.
struct Plan {
    ns: String,
    key: String,
    ttl_ms: u64,
    lease_ms: u64,
    owner: String,
}

async fn gate_and_run(args: RunArgs) -> anyhow::Result<u8> {
    // First of all: from here on a signal is caught, never the default action that would end
    // `run` after it took the key and before CMD started (found by an adversarial run: a TERM
    // 0.3 s after start left the key held, and in idempotent mode marked done for the ttl).
    let mut signals = Signals::install();
    let template =
        KeyTemplate::parse(&args.key).with_context(|| format!("--key {:?}", args.key))?;
    if !template.is_event_free() {
        bail!(
            "--key {:?}: a run key may use only {{now}} (with filters), there is no event",
            args.key
        );
    }
    let key = template.render(&Value::Null, now_ms())?;
    RecordId::new(args.namespace.as_str(), key.as_str())?;
    let plan = Plan {
        ns: args.namespace.clone(),
        key,
        ttl_ms: parse_duration_ms(&args.ttl).context("--ttl")?,
        lease_ms: lease_ms(&args.lease)?,
        owner: owner(),
    };
    let wait_timeout_ms = args
        .wait_timeout
        .as_deref()
        .map(parse_duration_ms)
        .transpose()
        .context("--wait-timeout")?;
    let lock_wait_ms = parse_duration_ms(&args.lock_wait).context("--lock-wait")?;
    let spec: Option<StoreSpec> = args.store.as_deref().map(str::parse).transpose()?;
    let backend = Backend::per_op(spec, args.server.as_deref(), lock_wait_ms).await;
    let backend = match signalled_while_asking(&mut signals, backend, |_| false)? {
        Ok(backend) => backend,
        Err(code) => return Ok(code),
    };

    match args.mode {
        RunMode::Idempotent => {
            let result =
                json!({"owner": plan.owner, "mode": "idempotent", "started_at": rfc3339(now_ms())});
            let marked = backend
                .mark(&plan.ns, &plan.key, plan.ttl_ms, Some(result))
                .await;
            let marked = match signalled_while_asking(&mut signals, marked, |m| {
                matches!(m, Mark::New { .. })
            })? {
                Ok(marked) => marked,
                Err(code) => return Ok(code),
            };
            match marked {
                Mark::Duplicate { record } => {
                    eprintln!("{}", skip_message(&plan.key, &record, false));
                    Ok(args.skip_exit_code)
                }
                Mark::New { record } => {
                    let outcome = match signals.before_cmd() {
                        Some(signo) => Outcome::not_started(128 + signo as u8),
                        None => {
                            let env = gate_env(&plan, record.fence);
                            spawn_and_wait(&args, &env, None, &mut signals).await
                        }
                    };
                    if !outcome.spawned {
                        // CMD never started: the mark would say it ran, and skip it for the ttl.
                        if let Err(e) = backend.forget(&plan.ns, &plan.key).await {
                            eprintln!(
                                "dedupgate run: CMD never started, but its mark could not be \
                                 removed ({e:#}); later triggers skip it until the ttl ends \
                                 (remove it with `dedupgate forget -n {} -k {}` and the same \
                                 --store or --server, with admin rights on a server)",
                                plan.ns,
                                shell_quoted(&plan.key)
                            );
                        }
                    }
                    Ok(outcome.exit_code)
                }
            }
        }
        RunMode::Retriable => {
            let started = Instant::now();
            let lease = loop {
                let opts = ClaimOptions {
                    ttl_ms: Some(plan.ttl_ms),
                    lease_ms: Some(plan.lease_ms),
                    fingerprint: None,
                    owner: Some(plan.owner.clone()),
                };
                let claimed = backend.claim(&plan.ns, &plan.key, opts).await;
                let claimed = match signalled_while_asking(&mut signals, claimed, |c| {
                    matches!(c, Claim::New(_))
                })? {
                    Ok(claimed) => claimed,
                    Err(code) => return Ok(code),
                };
                match claimed {
                    Claim::New(lease) => break lease,
                    Claim::Duplicate { record } => {
                        let waiting = args.wait
                            && record.state == State::InProgress
                            && wait_timeout_ms
                                .is_none_or(|t| started.elapsed() < Duration::from_millis(t));
                        if !waiting {
                            eprintln!("{}", skip_message(&plan.key, &record, args.wait));
                            return Ok(args.skip_exit_code);
                        }
                        let until_ms = record.lease_expires_at_ms.unwrap_or(0) as i64 - now_ms();
                        let pause = until_ms.clamp(50, WAIT_POLL_MS_MAX as i64) as u64;
                        // Nothing is held while waiting: a signal ends the wait and `run`.
                        if let Some(signo) = signals.during(Duration::from_millis(pause)).await {
                            return Ok(128 + signo as u8);
                        }
                    }
                }
            };
            let keep_alive = KeepAlive {
                backend: backend.clone(),
                ns: plan.ns.clone(),
                key: plan.key.clone(),
                token: lease.token.clone(),
                lease_ms: plan.lease_ms,
            };
            let run_started_ms = now_ms();
            let outcome = match signals.before_cmd() {
                // Released below, as after a failure.
                Some(signo) => Outcome::not_started(128 + signo as u8),
                None => {
                    let env = gate_env(&plan, lease.fence);
                    spawn_and_wait(&args, &env, Some(keep_alive), &mut signals).await
                }
            };
            if outcome.exit_code == 0 && outcome.spawned {
                let result = json!({
                    "exit_code": 0,
                    "owner": plan.owner,
                    "started_at": rfc3339(run_started_ms),
                    "duration_ms": now_ms() - run_started_ms,
                    "stdout_tail": outcome.stdout_tail,
                    "stderr_tail": outcome.stderr_tail,
                });
                match backend
                    .complete(&plan.ns, &plan.key, &lease.token, Some(result))
                    .await
                {
                    Ok(_) => Ok(0),
                    Err(e) => {
                        eprintln!(
                            "dedupgate run: CMD succeeded but its completion was not recorded \
                             ({e:#}); a later trigger may run it again"
                        );
                        Ok(EXIT_GATE_FAILED)
                    }
                }
            } else {
                if let Err(e) = backend.release(&plan.ns, &plan.key, &lease.token).await {
                    eprintln!(
                        "dedupgate run: CMD failed and the key could not be released ({e:#}); \
                         it is free again when the lease ends"
                    );
                }
                Ok(outcome.exit_code)
            }
        }
    }
}

/// Shortest `--lease`. The lease is renewed every third of it while CMD runs; one of a few
/// milliseconds ran out between renewals and let a second trigger run CMD beside the first.
/// Short leases stay allowed for tests of takeovers (the fence tells the runs apart); leases
/// of seconds or more are what a real job wants.
const LEASE_MS_MIN: u64 = 100;

fn lease_ms(text: &str) -> anyhow::Result<u64> {
    let ms = parse_duration_ms(text).context("--lease")?;
    if ms < LEASE_MS_MIN {
        bail!(
            "--lease {text:?}: at least {LEASE_MS_MIN}ms (it is renewed every third of it while \
             CMD runs; give a real job seconds)"
        );
    }
    Ok(ms)
}

/// Who holds a claim: host, process and a nonce of this run (`host:pid/nonce`), shown to the
/// triggers that find the key held. The owner must be unique to the run: the gate hands a claim
/// naming the holder's own owner back to it, and two runs can share host and pid (containers
/// with the host's hostname, each in its own pid namespace where `run` is often pid 1), which
/// would then both run CMD.
fn owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".to_owned());
    // RandomState's keys come from the operating system's random source (and differ for each
    // instance): 64 bits that tell two runs apart, without another dependency.
    let nonce = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
    owner_of(&host, std::process::id(), nonce)
}

/// At most [`OWNER_BYTES_MAX`] bytes: the host is what gets cut (on a character boundary:
/// `String::truncate` panics inside a character, and $HOSTNAME is whatever the environment
/// says), never the pid and nonce that make the owner unique.
fn owner_of(host: &str, pid: u32, nonce: u64) -> String {
    let tail = format!(":{pid}/{nonce:016x}");
    let mut end = host.len().min(OWNER_BYTES_MAX - tail.len());
    while !host.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{tail}", &host[..end])
}

/// Longest owner `run` names (the gate takes up to 256 bytes).
const OWNER_BYTES_MAX: usize = 200;

fn rfc3339(ms: i64) -> String {
    format_rfc3339_ms(ms, false).unwrap_or_else(|| ms.to_string())
}

/// Why a trigger skipped CMD; `waited`: it waited with `--wait` already (until
/// `--wait-timeout` ran out), so it does not suggest waiting.
fn skip_message(key: &str, record: &Record, waited: bool) -> String {
    let owner = record.owner.as_deref().unwrap_or("an unnamed worker");
    match record.state {
        State::InProgress => format!(
            "dedupgate run: skipped: {key:?} is running now (held by {owner} since {}, lease until {}); {}",
            rfc3339(record.created_at_ms as i64),
            rfc3339(record.lease_expires_at_ms.unwrap_or(0) as i64),
            if waited {
                "--wait-timeout ran out"
            } else {
                "give --wait to wait for it"
            },
        ),
        State::Completed => {
            let ran_by = record
                .result
                .as_ref()
                .and_then(|r| r.get("owner"))
                .and_then(Value::as_str)
                .unwrap_or(owner);
            let exit = record
                .result
                .as_ref()
                .and_then(|r| r.get("exit_code"))
                .and_then(Value::as_i64)
                .map(|c| format!(", exit {c}"))
                .unwrap_or_default();
            format!(
                "dedupgate run: skipped: {key:?} already ran (completed {} by {ran_by}{exit}); the key is kept until {}",
                rfc3339(record.completed_at_ms.unwrap_or(record.created_at_ms) as i64),
                rfc3339(record.expires_at_ms as i64),
            )
        }
    }
}

/// Renews a lease while CMD runs.
struct KeepAlive {
    backend: Backend,
    ns: String,
    key: String,
    token: Token,
    lease_ms: u64,
}

impl KeepAlive {
    async fn run_forever(self) {
        let period = Duration::from_millis((self.lease_ms / 3).max(1));
        loop {
            tokio::time::sleep(period).await;
            match self
                .backend
                .extend(&self.ns, &self.key, &self.token, self.lease_ms)
                .await
            {
                Ok(_) => {}
                Err(e) if is_lease_lost(&e) => {
                    eprintln!(
                        "dedupgate run: lease lost on {:?}: another trigger took the key over; \
                         CMD keeps running but its completion will not be recorded",
                        self.key
                    );
                    return;
                }
                Err(e) => {
                    // Transient: the lease is still ours until it ends; try again next period.
                    eprintln!("dedupgate run: renewing the lease failed: {e:#}");
                }
            }
        }
    }
}

/// What became of CMD.
struct Outcome {
    /// Whether CMD started at all.
    spawned: bool,
    exit_code: u8,
    stdout_tail: String,
    stderr_tail: String,
}

impl Outcome {
    /// CMD never started; `run` exits `exit_code`.
    fn not_started(exit_code: u8) -> Self {
        Self {
            spawned: false,
            exit_code,
            stdout_tail: String::new(),
            stderr_tail: String::new(),
        }
    }
}

/// What CMD learns of its claim through the environment, so it can pass the fence to the
/// systems it writes to and let them refuse a stale run (a fencing token).
fn gate_env(plan: &Plan, fence: u64) -> [(&'static str, String); 3] {
    [
        ("DEDUPGATE_NAMESPACE", plan.ns.clone()),
        ("DEDUPGATE_KEY", plan.key.clone()),
        ("DEDUPGATE_FENCE", fence.to_string()),
    ]
}

async fn spawn_and_wait(
    args: &RunArgs,
    env: &[(&'static str, String)],
    keep_alive: Option<KeepAlive>,
    signals: &mut Signals,
) -> Outcome {
    let (program, rest) = args.command.split_first().expect("clap requires CMD");
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(rest).stdin(Stdio::inherit());
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    if args.no_capture {
        cmd.stdout(Stdio::inherit()).stderr(Stdio::inherit());
    } else {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                EXIT_NOT_FOUND
            } else {
                EXIT_CANNOT_EXECUTE
            };
            eprintln!(
                "dedupgate run: cannot run {:?}: {e}",
                program.to_string_lossy()
            );
            return Outcome::not_started(code);
        }
    };
    let pid = child.id().map(|p| Pid::from_raw(p as i32));
    let stdout_tail = Arc::new(Mutex::new(Vec::new()));
    let stderr_tail = Arc::new(Mutex::new(Vec::new()));
    let mut copiers = Vec::new();
    if let Some(out) = child.stdout.take() {
        copiers.push(tokio::spawn(tee(
            out,
            tokio::io::stdout(),
            stdout_tail.clone(),
        )));
    }
    if let Some(err) = child.stderr.take() {
        copiers.push(tokio::spawn(tee(
            err,
            tokio::io::stderr(),
            stderr_tail.clone(),
        )));
    }
    let keep_alive = keep_alive.map(|k| tokio::spawn(k.run_forever()));

    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            Some((signo, forward)) = signals.rx.recv() => {
                if let (true, Some(pid), Ok(sig)) = (forward, pid, Signal::try_from(signo)) {
                    let _ = kill(pid, sig);
                }
            }
        }
    };
    if let Some(k) = keep_alive {
        k.abort();
    }
    let drain = async {
        for c in copiers {
            let _ = c.await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(OUTPUT_DRAIN_MS), drain).await;
    let exit_code = match status {
        Ok(s) => exit_code_of(s),
        Err(e) => {
            eprintln!("dedupgate run: waiting for CMD failed: {e}");
            EXIT_GATE_FAILED
        }
    };
    let tail = |t: &Arc<Mutex<Vec<u8>>>| {
        let bytes = t.lock().map(|v| v.clone()).unwrap_or_default();
        // The cut may fall inside a UTF-8 character: start at the next one.
        let start = bytes
            .iter()
            .take(3)
            .take_while(|&&b| b & 0xC0 == 0x80)
            .count();
        String::from_utf8_lossy(&bytes[start..]).into_owned()
    };
    Outcome {
        spawned: true,
        exit_code,
        stdout_tail: tail(&stdout_tail),
        stderr_tail: tail(&stderr_tail),
    }
}

/// The signals `run` catches from its start: passed on to CMD while it runs; before CMD
/// starts, they stop `run` instead, which first gives back the key it took.
///
/// On a terminal, Ctrl-C and Ctrl-\ already reach CMD through the foreground process group:
/// INT and QUIT are then caught (so `run` outlives them and can release the key once CMD has
/// exited) but not passed on a second time.
struct Signals {
    /// Each signal caught, and whether CMD is to get it.
    rx: tokio::sync::mpsc::Receiver<(i32, bool)>,
    listeners: Vec<tokio::task::JoinHandle<()>>,
}

impl Signals {
    fn install() -> Self {
        let interactive = std::io::stdin().is_terminal();
        let kinds = [
            (SignalKind::terminate(), true),
            (SignalKind::hangup(), true),
            (SignalKind::user_defined1(), true),
            (SignalKind::user_defined2(), true),
            (SignalKind::interrupt(), !interactive),
            (SignalKind::quit(), !interactive),
        ];
        let (tx, rx) = tokio::sync::mpsc::channel::<(i32, bool)>(16);
        let mut listeners = Vec::new();
        let ignored = ignored_at_start();
        for (kind, forward) in kinds {
            // A signal `run` was started with ignored (`nohup`, or INT and QUIT for a
            // background job of a non-interactive shell) stays ignored for `run` and for CMD,
            // which inherits that: catching it would pass it on, and CMD would die of it.
            let signo = kind.as_raw_value();
            if (1..=64).contains(&signo) && ignored & (1u64 << (signo - 1)) != 0 {
                continue;
            }
            if let Ok(mut s) = signal(kind) {
                let tx = tx.clone();
                listeners.push(tokio::spawn(async move {
                    while s.recv().await.is_some() {
                        if tx.send((kind.as_raw_value(), forward)).await.is_err() {
                            return;
                        }
                    }
                }));
            }
        }
        Self { rx, listeners }
    }

    /// A signal that came before CMD could start, if any (any caught signal, Ctrl-C too).
    fn before_cmd(&mut self) -> Option<i32> {
        self.rx.try_recv().ok().map(|(signo, _)| signo)
    }

    /// Waits `pause`, or less when a signal comes: the signal.
    async fn during(&mut self, pause: Duration) -> Option<i32> {
        tokio::select! {
            () = tokio::time::sleep(pause) => None,
            caught = self.rx.recv() => caught.map(|(signo, _)| signo),
        }
    }
}

/// A store call's answer, unless a signal came while `run` waited for it (a lock held by
/// another process, a slow connection) and the answer took nothing: then `run` stops with
/// `128 + N`, as for a signal before CMD starts. An answer that took the key goes on, so that
/// the signal is seen before CMD starts and the key is given back. `Ok(Err(code))`: stop with
/// `code`.
fn signalled_while_asking<A>(
    signals: &mut Signals,
    answer: anyhow::Result<A>,
    took_key: impl Fn(&A) -> bool,
) -> anyhow::Result<Result<A, u8>> {
    if matches!(&answer, Ok(a) if took_key(a)) {
        return answer.map(Ok);
    }
    match signals.before_cmd() {
        Some(signo) => {
            if let Err(e) = &answer {
                eprintln!("dedupgate run: stopped by signal {signo} while asking the store: {e:#}");
            }
            Ok(Err(128 + signo as u8))
        }
        None => answer.map(Ok),
    }
}

/// `text` as one word for a POSIX shell: as it is when it holds only safe characters, else in
/// single quotes (each `'` written as `'\''`).
fn shell_quoted(text: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "._:-/@%+=,".contains(c);
    if !text.is_empty() && text.chars().all(safe) {
        return text.to_owned();
    }
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The signals this process started with ignored, as a mask (bit `n - 1` for signal `n`), from
/// the `SigIgn` line of /proc/self/status; none where that cannot be read.
fn ignored_at_start() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("SigIgn:"))
                .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        })
        .unwrap_or(0)
}

impl Drop for Signals {
    fn drop(&mut self) {
        for l in &self.listeners {
            l.abort();
        }
    }
}

fn exit_code_of(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => (c & 0xff) as u8,
        (None, Some(sig)) => (128 + sig).min(255) as u8,
        (None, None) => EXIT_GATE_FAILED,
    }
}

/// Copies CMD's output to ours, keeping the last [`OUTPUT_TAIL_BYTES`].
async fn tee(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    tail: Arc<Mutex<Vec<u8>>>,
) {
    let mut buf = vec![0u8; 8192];
    let mut to_ok = true;
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to_ok {
            // Our own output may be closed (a cron job with no reader); CMD still runs.
            to_ok = to.write_all(&buf[..n]).await.is_ok() && to.flush().await.is_ok();
        }
        if let Ok(mut t) = tail.lock() {
            t.extend_from_slice(&buf[..n]);
            if t.len() > OUTPUT_TAIL_BYTES {
                let cut = t.len() - OUTPUT_TAIL_BYTES;
                t.drain(..cut);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{owner, owner_of};
    use dedupgate_core::{Claim, ClaimOptions, Gate, MemoryStore};

    #[test]
    fn keys_in_hints_are_quoted_for_a_shell() {
        assert_eq!(
            super::shell_quoted("backup:2026-11-22"),
            "backup:2026-11-22"
        );
        assert_eq!(super::shell_quoted("a b"), "'a b'");
        assert_eq!(super::shell_quoted("$(rm x)`y`"), "'$(rm x)`y`'");
        assert_eq!(super::shell_quoted("it's"), r"'it'\''s'");
        assert_eq!(super::shell_quoted(""), "''");
    }

    /// Two runs of one key on one host that share a pid (containers with the host's hostname,
    /// each in its own pid namespace where `run` is often pid 1) must not name the same owner:
    /// the gate hands a claim naming the holder's own owner back to it, so the second run would
    /// run CMD beside the first.
    #[tokio::test]
    async fn two_runs_with_one_host_and_pid_name_different_owners() {
        let (first, second) = (owner(), owner());
        assert_ne!(first, second);
        let gate = Gate::new(MemoryStore::new());
        let claim = |owner: &str| {
            gate.claim(
                "run",
                "nightly",
                ClaimOptions {
                    owner: Some(owner.to_owned()),
                    ..ClaimOptions::default()
                },
            )
        };
        assert!(matches!(claim(&first).await, Ok(Claim::New(_))));
        let again = claim(&second).await;
        assert!(
            matches!(again, Ok(Claim::Duplicate { .. })),
            "the second run was let in: {again:?}"
        );
    }

    #[test]
    fn a_long_non_ascii_host_is_cut_on_a_character_boundary() {
        let tail = ":7/0000000000000abc"; // 19 bytes: the host keeps at most 181
        let host = "ü".repeat(150); // 300 bytes; byte 181 falls inside a character, 180 does not
        let owner = owner_of(&host, 7, 0xabc);
        assert_eq!(owner.len(), 180 + tail.len(), "{owner}");
        assert!(owner.starts_with("üü"));
        assert!(owner.ends_with(tail), "{owner}");
        assert_eq!(owner_of("web-1", 42, 1), "web-1:42/0000000000000001");
    }
}
