//! `dedupgate dedup`: lets the first (or last) record of each key through a JSON Lines or CSV
//! stream. Without a ledger, keys are remembered in memory for this run (16 bytes per distinct
//! key). With `--ledger STORE` (or `--server URL`) keys are remembered in the gate across runs
//! with a ttl, and memory stays constant whatever the input size: re-running a pipeline over an
//! overlapping window emits only records not emitted before.
//!
//! Ledger protocol, per batch of at most [`LEDGER_BATCH_RECORDS`] records: claim every key of
//! the batch (one group commit), write the records whose claim is new, flush the output, then
//! complete those claims (one more commit). A run that dies between the claim and the complete
//! leaves leases that expire after [`LEDGER_LEASE_MS`], so the next run emits those records
//! again instead of losing them (its output is presumably redone too); a run that fails to
//! write releases its claims at once.
//!
//! Exit codes: 0 done; 1 failed (bad input without `--rejects`, I/O, the ledger); 2 bad usage.

use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use dedupgate_core::keys::{parse_duration_ms, RawObject};
use dedupgate_core::{Claim, Namespace, Token};

use super::pipeline::backend::{Backend, DEFAULT_LOCK_WAIT_MS};
use super::pipeline::input::{self, Format, Input};
use super::pipeline::keyspec::{short, KeyArgs, KeySpec, Prehashed, Scratch};
use super::pipeline::parallel::for_each_keyed_chunk;
use super::pipeline::records::{Keyed, Records};
use super::pipeline::{line_value, now_ms, progress, runtime, Rejects, PROGRESS_EVERY_LINES};
use dedupgate_stores::StoreSpec;

/// Most records per ledger batch (one claim commit and one complete commit each).
pub const LEDGER_BATCH_RECORDS: usize = 8192;
/// Most output bytes held per ledger batch.
pub const LEDGER_BATCH_BYTES: usize = 8 << 20;
/// Lease of a ledger claim: how long a crashed run's records stay held before the next run
/// may emit them.
pub const LEDGER_LEASE_MS: u64 = 10 * 60 * 1000;

/// Which record of a key is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Keep {
    /// The first one seen (streams in one pass).
    First,
    /// The last one seen (two passes; stdin is spooled to a temporary file).
    Last,
}

/// How the ledger records keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LedgerMode {
    /// Claim, write, complete: a run that dies before completing lets the next run emit those
    /// records again (nothing is lost). Two ledger writes per new key.
    Retriable,
    /// Mark, then write: one ledger write per new key, but a run that dies between the two
    /// loses up to one batch of records for good.
    AtMostOnce,
}

/// Flags of `dedupgate dedup`.
#[derive(clap::Args, Debug)]
pub struct DedupArgs {
    #[command(flatten)]
    key: KeyArgs,
    /// Input files (JSON Lines or CSV, by extension or --format); none or `-` reads stdin.
    inputs: Vec<PathBuf>,
    /// Output file [default: stdout].
    #[arg(short, long, value_name = "OUT")]
    output: Option<PathBuf>,
    /// Input and output format [default: by extension, else jsonl].
    #[arg(long, value_enum)]
    format: Option<Format>,
    /// Which record of each key to keep.
    #[arg(long, value_enum, default_value_t = Keep::First)]
    keep: Keep,
    /// Add the record's id (hex SHA-256 of its key, API.md) under this field or column.
    #[arg(long, value_name = "FIELD")]
    emit_id: Option<String>,
    /// Remember keys across runs in this store (same forms as --store: a path, embedded:PATH,
    /// memory:, redis://…, postgres://…, tiered:…).
    #[arg(long, value_name = "STORE", env = "DEDUPGATE_LEDGER")]
    ledger: Option<String>,
    /// Remember keys across runs in the dedupgate server at URL.
    #[arg(long, value_name = "URL", conflicts_with = "ledger")]
    server: Option<String>,
    /// How long the ledger remembers a key (500ms, 30s, 5m, 24h, 7d).
    #[arg(long, default_value = "24h", value_name = "D")]
    ttl: String,
    /// How the ledger records keys: retriable (claim, write, complete) or at-most-once (mark,
    /// write; half the ledger writes, but a crash can lose the last batch).
    #[arg(long, value_enum, default_value_t = LedgerMode::Retriable)]
    ledger_mode: LedgerMode,
    /// Ledger namespace.
    #[arg(long, default_value = "dedup", value_name = "NS")]
    namespace: String,
    /// Write records without a key here (JSON Lines: file, line, reason, record) and go on;
    /// without it the first such record stops the run.
    #[arg(long, value_name = "FILE")]
    rejects: Option<PathBuf>,
    /// No progress bar and no summary line.
    #[arg(short, long)]
    quiet: bool,
    /// How long to wait for an embedded ledger another process holds.
    #[arg(long, default_value = "30s", value_name = "D")]
    lock_wait: String,
}

/// Counts for the summary line.
#[derive(Default, Debug)]
struct Counts {
    read: u64,
    emitted: u64,
    duplicates: u64,
}

/// Runs `dedupgate dedup`.
pub fn run(args: DedupArgs) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let spec = args.key.spec()?;
    let inputs = Input::from_args(&args.inputs);
    if inputs.iter().filter(|i| **i == Input::Stdin).count() > 1 {
        bail!("stdin (-) may be given only once");
    }
    let format = Format::resolve(args.format, &inputs)?;
    let ttl_ms = parse_duration_ms(&args.ttl).context("--ttl")?;
    let lock_wait_ms = parse_duration_ms(&args.lock_wait).unwrap_or(DEFAULT_LOCK_WAIT_MS);
    Namespace::new(args.namespace.clone()).context("--namespace")?;
    let mut rejects = Rejects::open(args.rejects.as_deref())?;
    let rt = runtime()?;
    let ledger = match (&args.ledger, &args.server) {
        (None, None) => None,
        (ledger, server) => {
            let spec: Option<StoreSpec> = ledger.as_deref().map(str::parse).transpose()?;
            Some(rt.block_on(Backend::open(spec, server.as_deref(), lock_wait_ms))?)
        }
    };
    let (inputs, _spool) = match args.keep {
        Keep::First => (inputs, None),
        Keep::Last => input::spool_stdin(inputs)?,
    };
    let bar = progress(input::total_bytes(&inputs), args.quiet);
    let mut out = input::open_output(args.output.as_deref())?;
    let mut job = Job {
        spec: &spec,
        format,
        emit_id: args.emit_id.as_deref(),
        now_ms: now_ms(),
        counts: Counts::default(),
        rejects: &mut rejects,
        bar: &bar,
    };
    let result = match (&ledger, args.keep) {
        (None, Keep::First) if format == Format::Jsonl => {
            job.first_in_memory_jsonl(inputs, &mut *out)
        }
        (Some(backend), Keep::First) if format == Format::Jsonl => {
            let mut sink = LedgerSink::new(backend, &args.namespace, ttl_ms, args.ledger_mode, &rt);
            job.first_with_ledger_jsonl(inputs, &mut sink, &mut *out)
        }
        (None, Keep::First) => job.first_in_memory(inputs, &mut *out),
        (None, Keep::Last) => job.last(inputs, None, &mut *out),
        (Some(backend), Keep::First) => {
            let mut sink = LedgerSink::new(backend, &args.namespace, ttl_ms, args.ledger_mode, &rt);
            job.first_with_ledger(inputs, &mut sink, &mut *out)
        }
        (Some(backend), Keep::Last) => {
            let mut sink = LedgerSink::new(backend, &args.namespace, ttl_ms, args.ledger_mode, &rt);
            job.last(inputs, Some(&mut sink), &mut *out)
        }
    };
    bar.finish_and_clear();
    let counts = std::mem::take(&mut job.counts);
    result?;
    out.flush().context("writing the output")?;
    rejects.finish()?;
    if !args.quiet {
        eprintln!(
            "dedupgate dedup: read {}, emitted {}, duplicates {}, rejected {} ({:.2}s)",
            counts.read,
            counts.emitted,
            counts.duplicates,
            rejects.count,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(ExitCode::SUCCESS)
}

struct Job<'a> {
    spec: &'a KeySpec,
    format: Format,
    emit_id: Option<&'a str>,
    now_ms: i64,
    counts: Counts,
    rejects: &'a mut Rejects,
    bar: &'a indicatif::ProgressBar,
}

impl Job<'_> {
    fn tick(&self, records: &Records) {
        if self.counts.read % PROGRESS_EVERY_LINES == 0 {
            self.bar.set_position(records.bytes_read());
        }
    }

    /// Keep first, no ledger, JSON Lines: keys computed on a second thread, in memory here.
    fn first_in_memory_jsonl(
        &mut self,
        inputs: Vec<Input>,
        out: &mut dyn Write,
    ) -> anyhow::Result<()> {
        let total_bytes = input::total_bytes(&inputs);
        let mut seen: HashSet<u128, Prehashed> = HashSet::default();
        let mut sized = false;
        let (counts, rejects, bar, emit_id) =
            (&mut self.counts, &mut *self.rejects, self.bar, self.emit_id);
        for_each_keyed_chunk(inputs, self.spec, self.now_ms, |kc| {
            if !sized {
                // Room for half the estimated lines as distinct keys: one growth at most
                // when fewer than half are duplicates.
                sized = true;
                if let Some(total) = total_bytes {
                    let per_line = kc.chunk.data.len() as u64 / (kc.lines.len() as u64).max(1);
                    let estimate = total / per_line.max(1) / 2;
                    seen.reserve(estimate.min(1 << 28) as usize);
                }
            }
            for line in &kc.lines {
                counts.read += 1;
                let bytes = &kc.chunk.data[line.span.clone()];
                match &line.key {
                    Err(reason) => {
                        rejects.reject(&kc.position(line), &reason.0, line_value(bytes))?
                    }
                    Ok(digest) => {
                        if seen.insert(short(digest)) {
                            counts.emitted += 1;
                            write_line(bytes, emit_id, digest, out)?;
                        } else {
                            counts.duplicates += 1;
                        }
                    }
                }
            }
            bar.set_position(kc.chunk.bytes_read_total);
            Ok(())
        })
    }

    /// Keep first with a ledger, JSON Lines: keys computed on a second thread.
    fn first_with_ledger_jsonl(
        &mut self,
        inputs: Vec<Input>,
        sink: &mut LedgerSink<'_>,
        out: &mut dyn Write,
    ) -> anyhow::Result<()> {
        let (counts, rejects, bar, emit_id) =
            (&mut self.counts, &mut *self.rejects, self.bar, self.emit_id);
        let spec = self.spec;
        for_each_keyed_chunk(inputs, self.spec, self.now_ms, |kc| {
            for line in &kc.lines {
                counts.read += 1;
                let bytes = &kc.chunk.data[line.span.clone()];
                match &line.key {
                    Err(reason) => {
                        rejects.reject(&kc.position(line), &reason.0, line_value(bytes))?
                    }
                    Ok(digest) => {
                        if !sink.batch_ids.insert(short(digest)) {
                            counts.duplicates += 1;
                            continue;
                        }
                        let key = match (spec, &line.text) {
                            (KeySpec::Template(_), Some(text)) => text.clone(),
                            _ => hex::encode(digest),
                        };
                        let start = sink.bytes.len();
                        write_line(bytes, emit_id, digest, &mut sink.bytes)?;
                        sink.pending.push((key, start..sink.bytes.len()));
                        if sink.is_full() {
                            sink.flush(counts, out)?;
                        }
                    }
                }
            }
            bar.set_position(kc.chunk.bytes_read_total);
            Ok(())
        })?;
        sink.flush(&mut self.counts, out)
    }

    /// Keep first, no ledger: one pass, keys in memory.
    fn first_in_memory(&mut self, inputs: Vec<Input>, out: &mut dyn Write) -> anyhow::Result<()> {
        let expected = input::total_bytes(&inputs).map_or(1 << 16, |b| (b / 256).min(1 << 26));
        let mut seen: HashSet<u128, Prehashed> =
            HashSet::with_capacity_and_hasher(expected as usize, Prehashed::default());
        let mut records = Records::open(self.format, inputs);
        let mut scratch = Scratch::default();
        let mut header_done = false;
        while let Some(keyed) = records.next(self.spec, self.now_ms, &mut scratch)? {
            self.counts.read += 1;
            self.tick(&records);
            if !header_done {
                records.write_header(self.emit_id, out)?;
                header_done = true;
            }
            match keyed {
                Keyed::Rejected(pos, reason, value) => {
                    self.rejects.reject(&pos, &reason.0, value)?
                }
                Keyed::Key(digest) => {
                    if seen.insert(short(&digest)) {
                        self.counts.emitted += 1;
                        let hex;
                        let id = match self.emit_id {
                            Some(f) => {
                                hex = hex::encode(digest);
                                Some((f, hex.as_str()))
                            }
                            None => None,
                        };
                        records.encode(id, out).context("writing the output")?;
                    } else {
                        self.counts.duplicates += 1;
                    }
                }
            }
        }
        if !header_done {
            records.write_header(self.emit_id, out)?; // a CSV input with a header and no rows
        }
        Ok(())
    }

    /// Keep first with a ledger: batches of claims, constant memory.
    fn first_with_ledger(
        &mut self,
        inputs: Vec<Input>,
        sink: &mut LedgerSink<'_>,
        out: &mut dyn Write,
    ) -> anyhow::Result<()> {
        let mut records = Records::open(self.format, inputs);
        let mut scratch = Scratch::default();
        let mut header_done = false;
        while let Some(keyed) = records.next(self.spec, self.now_ms, &mut scratch)? {
            self.counts.read += 1;
            self.tick(&records);
            if !header_done {
                records.write_header(self.emit_id, out)?;
                header_done = true;
            }
            match keyed {
                Keyed::Rejected(pos, reason, value) => {
                    self.rejects.reject(&pos, &reason.0, value)?
                }
                Keyed::Key(digest) => {
                    self.offer(&mut records, &digest, &scratch, sink)?;
                    if sink.is_full() {
                        sink.flush(&mut self.counts, out)?;
                    }
                }
            }
        }
        if !header_done {
            records.write_header(self.emit_id, out)?;
        }
        sink.flush(&mut self.counts, out)
    }

    /// Puts one record into the ledger batch.
    fn offer(
        &mut self,
        records: &mut Records,
        digest: &[u8; 32],
        scratch: &Scratch,
        sink: &mut LedgerSink<'_>,
    ) -> anyhow::Result<()> {
        if !sink.batch_ids.insert(short(digest)) {
            // The same key earlier in this batch: the batch's one owner would get that claim
            // back as "new", so repeats are settled here.
            self.counts.duplicates += 1;
            return Ok(());
        }
        let key = self.spec.ledger_key(digest, scratch);
        let start = sink.bytes.len();
        let hex;
        let id = match self.emit_id {
            Some(f) => {
                hex = hex::encode(digest);
                Some((f, hex.as_str()))
            }
            None => None,
        };
        records.encode(id, &mut sink.bytes)?;
        sink.pending.push((key, start..sink.bytes.len()));
        Ok(())
    }

    /// Keep last: pass 1 finds each key's last record, pass 2 emits those (through the ledger
    /// when there is one).
    fn last(
        &mut self,
        inputs: Vec<Input>,
        mut sink: Option<&mut LedgerSink<'_>>,
        out: &mut dyn Write,
    ) -> anyhow::Result<()> {
        let mut last: std::collections::HashMap<u128, u64, Prehashed> = Default::default();
        let mut scratch = Scratch::default();
        let mut records = Records::open(self.format, inputs.clone());
        let mut index = 0u64;
        while let Some(keyed) = records.next(self.spec, self.now_ms, &mut scratch)? {
            self.counts.read += 1;
            self.tick(&records);
            match keyed {
                Keyed::Rejected(pos, reason, value) => {
                    self.rejects.reject(&pos, &reason.0, value)?
                }
                Keyed::Key(digest) => {
                    last.insert(short(&digest), index);
                }
            }
            index += 1;
        }
        let mut records = Records::open(self.format, inputs);
        let mut index = 0u64;
        let mut header_done = false;
        while let Some(keyed) = records.next(self.spec, self.now_ms, &mut scratch)? {
            if !header_done {
                records.write_header(self.emit_id, out)?;
                header_done = true;
            }
            let this = index;
            index += 1;
            let Keyed::Key(digest) = keyed else {
                continue; // reported in pass 1
            };
            if last.get(&short(&digest)) != Some(&this) {
                self.counts.duplicates += 1;
                continue;
            }
            match sink.as_deref_mut() {
                Some(sink) => {
                    self.offer(&mut records, &digest, &scratch, sink)?;
                    if sink.is_full() {
                        sink.flush(&mut self.counts, out)?;
                    }
                }
                None => {
                    self.counts.emitted += 1;
                    let hex;
                    let id = match self.emit_id {
                        Some(f) => {
                            hex = hex::encode(digest);
                            Some((f, hex.as_str()))
                        }
                        None => None,
                    };
                    records.encode(id, out).context("writing the output")?;
                }
            }
        }
        if !header_done {
            records.write_header(self.emit_id, out)?;
        }
        if let Some(sink) = sink {
            sink.flush(&mut self.counts, out)?;
        }
        Ok(())
    }
}

/// Writes one JSON line, with its id under `emit_id` when given.
fn write_line(
    line: &[u8],
    emit_id: Option<&str>,
    digest: &[u8; 32],
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    match emit_id {
        None => out.write_all(line).context("writing the output")?,
        Some(field) => {
            // The line was parsed as an object to key it, so it is UTF-8 and an object.
            let text = std::str::from_utf8(line).context("record is not UTF-8")?;
            let obj = RawObject::parse(text)?;
            out.write_all(
                obj.with_string_field(field, &hex::encode(digest))
                    .as_bytes(),
            )
            .context("writing the output")?;
        }
    }
    out.write_all(b"\n").context("writing the output")?;
    Ok(())
}

/// A batch of records waiting for their ledger claims.
struct LedgerSink<'a> {
    backend: &'a Backend,
    namespace: &'a str,
    ttl_ms: u64,
    mode: LedgerMode,
    rt: &'a tokio::runtime::Runtime,
    /// Claims of this run name this owner, so a retried batch gets its own claims back.
    owner: String,
    /// Encoded records of the batch, back to back.
    bytes: Vec<u8>,
    /// Each record's ledger key and its bytes.
    pending: Vec<(String, std::ops::Range<usize>)>,
    /// Keys of the batch (see [`Job::offer`]).
    batch_ids: HashSet<u128, Prehashed>,
}

impl<'a> LedgerSink<'a> {
    fn new(
        backend: &'a Backend,
        namespace: &'a str,
        ttl_ms: u64,
        mode: LedgerMode,
        rt: &'a tokio::runtime::Runtime,
    ) -> Self {
        Self {
            backend,
            namespace,
            ttl_ms,
            mode,
            rt,
            owner: format!("dedup-{}", Token::generate().as_str()),
            bytes: Vec::with_capacity(LEDGER_BATCH_BYTES),
            pending: Vec::with_capacity(LEDGER_BATCH_RECORDS),
            batch_ids: HashSet::with_capacity_and_hasher(
                LEDGER_BATCH_RECORDS,
                Prehashed::default(),
            ),
        }
    }

    fn is_full(&self) -> bool {
        self.pending.len() >= LEDGER_BATCH_RECORDS || self.bytes.len() >= LEDGER_BATCH_BYTES
    }

    /// Marks the batch's keys, then writes the records whose mark was new.
    fn flush_marked(
        &mut self,
        keys: &[String],
        counts: &mut Counts,
        out: &mut dyn Write,
    ) -> anyhow::Result<()> {
        let answers = self
            .rt
            .block_on(self.backend.mark_batch(self.namespace, keys, self.ttl_ms))
            .with_context(|| format!("ledger {}", self.backend.describe()))?;
        if answers.len() != keys.len() {
            bail!(
                "the ledger answered {} marks for {} keys",
                answers.len(),
                keys.len()
            );
        }
        let mut lost = 0u64;
        let mut failure: Option<anyhow::Error> = None;
        for ((key, span), answer) in self.pending.drain(..).zip(answers) {
            match answer {
                Ok(true) if failure.is_none() => match out.write_all(&self.bytes[span]) {
                    Ok(()) => counts.emitted += 1,
                    Err(e) => {
                        lost += 1;
                        failure = Some(anyhow::Error::new(e).context("writing the output"));
                    }
                },
                Ok(true) => lost += 1,
                Ok(false) => counts.duplicates += 1,
                Err(reason) => {
                    failure.get_or_insert_with(|| {
                        anyhow::anyhow!("ledger refused key {key:?}: {reason}")
                    });
                }
            }
        }
        self.bytes.clear();
        self.batch_ids.clear();
        if failure.is_none() {
            if let Err(e) = out.flush() {
                failure = Some(anyhow::Error::new(e).context("writing the output"));
            }
        }
        match failure {
            None => Ok(()),
            Some(e) => Err(e.context(format!(
                "at-most-once ledger: {lost} marked records were not written and will not be \
                 emitted by a later run (use forget, or the default retriable mode)"
            ))),
        }
    }

    /// Claims the batch's keys, writes the new records, flushes, completes their claims.
    fn flush(&mut self, counts: &mut Counts, out: &mut dyn Write) -> anyhow::Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let keys: Vec<String> = self.pending.iter().map(|(k, _)| k.clone()).collect();
        if self.mode == LedgerMode::AtMostOnce {
            return self.flush_marked(&keys, counts, out);
        }
        let answers = self
            .rt
            .block_on(self.backend.claim_batch(
                self.namespace,
                &keys,
                self.ttl_ms,
                LEDGER_LEASE_MS,
                &self.owner,
            ))
            .with_context(|| format!("ledger {}", self.backend.describe()))?;
        if answers.len() != keys.len() {
            bail!(
                "the ledger answered {} claims for {} keys",
                answers.len(),
                keys.len()
            );
        }
        let mut claimed: Vec<(String, Token)> = Vec::new();
        let mut failure = None;
        for ((key, span), answer) in self.pending.drain(..).zip(answers) {
            match answer {
                Ok(Claim::New(lease)) => {
                    if failure.is_none() {
                        if let Err(e) = out.write_all(&self.bytes[span]) {
                            failure = Some(anyhow::Error::new(e).context("writing the output"));
                        }
                    }
                    claimed.push((key, lease.token));
                }
                Ok(Claim::Duplicate { .. }) => counts.duplicates += 1,
                Err(reason) => {
                    failure.get_or_insert_with(|| {
                        anyhow::anyhow!("ledger refused key {key:?}: {reason}")
                    });
                }
            }
        }
        if failure.is_none() {
            if let Err(e) = out.flush() {
                failure = Some(anyhow::Error::new(e).context("writing the output"));
            }
        }
        self.bytes.clear();
        self.batch_ids.clear();
        if let Some(e) = failure {
            // Nothing of this batch counts as emitted: give the keys back at once.
            self.rt
                .block_on(self.backend.release_batch(self.namespace, &claimed));
            return Err(e);
        }
        counts.emitted += claimed.len() as u64;
        self.rt
            .block_on(
                self.backend
                    .complete_batch(self.namespace, &claimed, self.ttl_ms),
            )
            .with_context(|| {
                format!(
                    "ledger {}: the records were written but not recorded; they will be \
                     emitted again by a run after the {}s lease",
                    self.backend.describe(),
                    LEDGER_LEASE_MS / 1000
                )
            })
    }
}
