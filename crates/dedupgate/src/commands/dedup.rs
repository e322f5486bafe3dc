//! `dedupgate dedup`: lets the first (or last) record of each key through a JSON Lines or CSV
//! stream. Without a ledger, keys are remembered in memory for this run (16 bytes per distinct
//! key). With `--ledger STORE` (or `--server URL`) keys are remembered in the gate across runs
//! with a ttl, and memory stays bounded whatever the input size: re-running a pipeline over an
//! overlapping window emits only records not emitted before.
//!
//! Ledger protocol ([`ledger`]): a key this run saw within its window of recent keys is a
//! duplicate without asking the ledger; the others go to the ledger in batches, one call per
//! batch in flight while the next batch is keyed. Retriable mode (default): write and flush the
//! records the ledger found new, and only then record their keys (an embedded store's key set:
//! in the next call; a gate: claims made first, completed in the next call, with leases that
//! expire after [`ledger::LEDGER_LEASE_MS`]), so a run that dies in between makes the next run
//! emit those records again instead of losing them (its output is presumably redone too).
//! At-most-once mode records the keys first, then writes the new records.
//!
//! Exit codes: 0 done; 1 failed (bad input without `--rejects`, I/O, the ledger); 2 bad usage.

mod ledger;

use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use dedupgate_core::keys::RawObject;
use dedupgate_core::Namespace;

use super::is_output_closed;
use super::pipeline::backend::Backend;
use super::pipeline::input::{self, check_inputs, check_outputs, Format, Input, Output};
use super::pipeline::keyspec::{short, KeyArgs, KeySpec, Prehashed, Scratch};
use super::pipeline::parallel::for_each_keyed_chunk;
use super::pipeline::records::{Keyed, Records};
use super::pipeline::{
    check_interrupt, interrupt_flag, line_value, now_ms, progress, report_failure, summary, usage,
    Rejects, PROGRESS_EVERY_LINES,
};
use dedupgate_stores::EmbeddedOptions;
use dedupgate_stores::StoreSpec;
use ledger::Ledger;

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
    /// Write, then record (a gate ledger: claim, write, complete): a run that dies before
    /// recording lets the next run emit those records again (nothing is lost).
    Retriable,
    /// Record (mark), then write: a gate ledger makes one write per new key instead of two,
    /// but a run that dies between the two loses the records of the calls in flight for good
    /// (up to one batch with gate records, three with an embedded ledger).
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
    #[arg(long, default_value = "24h", value_name = "D", value_parser = dedupgate_server::parse_duration_ms)]
    ttl: u64,
    /// How the ledger records keys: retriable (write, then record: a crash makes the next run
    /// emit the last batch again) or at-most-once (record, then write: a crash can lose it).
    #[arg(long, value_enum, default_value_t = LedgerMode::Retriable)]
    ledger_mode: LedgerMode,
    /// MiB of block cache for an embedded ledger (1..=65536): the on-disk part of its key set
    /// (past --ledger-memory-keys) and gate records are read through it.
    #[arg(long, default_value_t = 64, value_name = "MIB",
          value_parser = clap::value_parser!(u64).range(1..=65_536))]
    ledger_cache_mb: u64,
    /// Keys of an embedded ledger held in memory (about 40-60 bytes each; default 8388608, so
    /// about 0.5 GB at most, whatever the input size). Past it, the keys that expire first move
    /// to an index on disk, where each lookup of a key not in memory is an LSM read.
    #[arg(long, default_value_t = dedupgate_stores::KEY_SET_MEMORY_IDS_DEFAULT, value_name = "KEYS",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=u64::from(u32::MAX)))]
    ledger_memory_keys: usize,
    /// Ledger namespace.
    #[arg(long, default_value = "dedup", value_name = "NS")]
    namespace: String,
    /// Records per ledger call (1..=5000).
    #[arg(long, default_value_t = ledger::LEDGER_BATCH_RECORDS, value_name = "N",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
              .range(1..=ledger::LEDGER_BATCH_RECORDS_MAX as u64))]
    ledger_batch: usize,
    /// Keys this run remembers in memory beside a ledger (about 36 bytes each): a repeat within
    /// them is a duplicate without asking the ledger. At least four batches (six for an
    /// embedded ledger, which keeps two calls in flight). Default: 1048576 for a ledger through
    /// a server or a gate store; the least for an embedded ledger, whose key set answers from
    /// memory anyway.
    #[arg(long, value_name = "KEYS",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new()
              .range(0..=ledger::LEDGER_WINDOW_KEYS_MAX as u64))]
    ledger_window: Option<usize>,
    /// Write records without a key here (JSON Lines: file, line, reason, record) and go on;
    /// without it the first such record stops the run.
    #[arg(long, value_name = "FILE")]
    rejects: Option<PathBuf>,
    /// No progress bar and no summary line.
    #[arg(short, long)]
    quiet: bool,
    /// How long to wait for an embedded ledger another process holds.
    #[arg(long, default_value = "30s", value_name = "D", value_parser = dedupgate_server::parse_duration_ms)]
    lock_wait: u64,
}

/// Counts for the summary line.
#[derive(Default, Debug)]
struct Counts {
    read: u64,
    emitted: u64,
    duplicates: u64,
}

/// Runs `dedupgate dedup`: a usage error exits 2, any other failure 1.
pub fn run(args: DedupArgs) -> anyhow::Result<ExitCode> {
    Ok(dedup(args).unwrap_or_else(|e| report_failure("dedup", &e)))
}

fn dedup(args: DedupArgs) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let spec = args.key.spec()?;
    let inputs = Input::from_args(&args.inputs);
    if inputs.iter().filter(|i| **i == Input::Stdin).count() > 1 {
        return Err(usage("stdin (-) may be given only once"));
    }
    let format = Format::resolve(args.format, &inputs)?;
    let (ttl_ms, lock_wait_ms) = (args.ttl, args.lock_wait);
    Namespace::new(args.namespace.clone()).map_err(|e| usage(format!("--namespace: {e}")))?;
    let store_spec: Option<StoreSpec> = args
        .ledger
        .as_deref()
        .map(|s| s.parse().map_err(|e| usage(format!("--ledger: {e}"))))
        .transpose()?;
    // Nothing is created or truncated before the inputs are known to be readable and no
    // output names an input or another output.
    let mut outputs = vec![Output::of("-o", args.output.as_deref())];
    if let Some(rejects) = &args.rejects {
        outputs.push(Output::File("--rejects", rejects));
    }
    check_outputs(&inputs, &outputs)?;
    if let Some(StoreSpec::Embedded(dir)) = &store_spec {
        input::check_outputs_outside(dir, &outputs)?;
    }
    check_inputs(&inputs)?;
    // One worker thread: a ledger call runs there while this thread keys the next batch.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let ledger = match (&args.ledger, &args.server) {
        (None, None) => None,
        (_, server) => {
            let embedded = EmbeddedOptions {
                cache_bytes: args.ledger_cache_mb << 20,
                key_set_memory_ids: args.ledger_memory_keys,
                ..EmbeddedOptions::default()
            };
            Some(rt.block_on(Backend::open_with(
                store_spec,
                server.as_deref(),
                lock_wait_ms,
                embedded,
            ))?)
        }
    };
    // Outputs before stdin is read: an output that cannot be created stops the run while the
    // input is still unread, rather than after `--keep last` has consumed it into its spool.
    let mut rejects = Rejects::open(args.rejects.as_deref())?;
    let mut out = input::open_output(args.output.as_deref())?;
    let (inputs, _spool) = match args.keep {
        Keep::First => (inputs, None),
        Keep::Last => input::spool_stdin(inputs)?,
    };
    let bar = progress(input::total_bytes(&inputs), args.quiet);
    let interrupted = interrupt_flag();
    let mut job = Job {
        interrupted: &interrupted,
        spec: &spec,
        format,
        emit_id: args.emit_id.as_deref(),
        now_ms: now_ms(),
        counts: Counts::default(),
        rejects: &mut rejects,
        bar: &bar,
    };
    let mut book = ledger.as_ref().map(|backend| {
        Ledger::new(
            backend,
            &args.namespace,
            ttl_ms,
            args.ledger_mode,
            &rt,
            args.ledger_batch,
            args.ledger_window,
        )
    });
    let result = match (book.as_mut(), args.keep) {
        (None, Keep::First) if format == Format::Jsonl => {
            job.first_in_memory_jsonl(inputs, &mut *out)
        }
        (Some(book), Keep::First) if format == Format::Jsonl => {
            job.first_with_ledger_jsonl(inputs, book, &mut *out)
        }
        (None, Keep::First) => job.first_in_memory(inputs, &mut *out),
        (None, Keep::Last) => job.last(inputs, None, &mut *out),
        (Some(book), Keep::First) => job.first_with_ledger(inputs, book, &mut *out),
        (Some(book), Keep::Last) => job.last(inputs, Some(book), &mut *out),
    };
    // Records whose ledger call went out before a failure are settled as in a clean run.
    let result = match (result, book.as_mut()) {
        (Ok(()), Some(book)) => book.finish(&mut job.counts, &mut *out),
        (Err(e), Some(book)) => {
            if let Err(e2) = book.abandon(&mut job.counts, &mut *out) {
                if !is_output_closed(&e2) {
                    tracing::warn!("while stopping: {e2:#}");
                }
            }
            Err(e)
        }
        (result, None) => result,
    };
    bar.finish_and_clear();
    let counts = std::mem::take(&mut job.counts);
    let summary = |how: &str, rejected: u64| {
        if !args.quiet {
            // Records read but neither written, dropped nor rejected: those of the batch not
            // yet sent or given back when a run stopped. Zero in a finished run.
            let not_emitted = counts
                .read
                .saturating_sub(counts.emitted + counts.duplicates + rejected);
            let line = summary(
                "dedup",
                !how.is_empty(),
                counts.read,
                &[
                    ("emitted", counts.emitted),
                    ("duplicates", counts.duplicates),
                    ("rejected", rejected),
                ],
                &[("in flight, not emitted", not_emitted)],
                started,
            );
            eprintln!("{line}");
        }
    };
    if let Err(e) = result {
        // A reader that closed the output (`| head`) ends the run quietly, as jq and ripgrep do.
        if is_output_closed(&e) {
            return Err(e);
        }
        // What was emitted before the stop is written out and counted, then the reason.
        if let Err(flush) = out.flush() {
            tracing::warn!("while stopping: writing the output: {flush}");
        }
        summary("stopped: ", rejects.count);
        return Err(e);
    }
    out.flush().context("writing the output")?;
    rejects.finish()?;
    summary("", rejects.count);
    Ok(ExitCode::SUCCESS)
}

struct Job<'a> {
    /// Set by SIGINT: the run stops between records.
    interrupted: &'a std::sync::atomic::AtomicBool,
    spec: &'a KeySpec,
    format: Format,
    emit_id: Option<&'a str>,
    now_ms: i64,
    counts: Counts,
    rejects: &'a mut Rejects,
    bar: &'a indicatif::ProgressBar,
}

impl Job<'_> {
    fn tick(&self, records: &Records) -> anyhow::Result<()> {
        if self.counts.read % PROGRESS_EVERY_LINES == 0 {
            self.bar.set_position(records.bytes_read());
        }
        check_interrupt(self.interrupted)
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
        let interrupted = self.interrupted;
        for_each_keyed_chunk(inputs, self.spec, self.now_ms, |kc| {
            check_interrupt(interrupted)?;
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
        book: &mut Ledger<'_>,
        out: &mut dyn Write,
    ) -> anyhow::Result<()> {
        let (counts, rejects, bar, emit_id) =
            (&mut self.counts, &mut *self.rejects, self.bar, self.emit_id);
        let spec = self.spec;
        let interrupted = self.interrupted;
        for_each_keyed_chunk(inputs, self.spec, self.now_ms, |kc| {
            check_interrupt(interrupted)?;
            for line in &kc.lines {
                counts.read += 1;
                let bytes = &kc.chunk.data[line.span.clone()];
                match &line.key {
                    Err(reason) => {
                        rejects.reject(&kc.position(line), &reason.0, line_value(bytes))?
                    }
                    Ok(digest) => {
                        if !book.first_sighting(digest) {
                            counts.duplicates += 1;
                            continue;
                        }
                        let key = || match (spec, &line.text) {
                            (KeySpec::Template(_), Some(text)) => text.clone(),
                            _ => hex::encode(digest),
                        };
                        book.push(
                            digest,
                            key,
                            |buf| write_line(bytes, emit_id, digest, buf),
                            counts,
                            out,
                        )?;
                    }
                }
            }
            bar.set_position(kc.chunk.bytes_read_total);
            Ok(())
        })
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
            self.tick(&records)?;
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

    /// Keep first with a ledger: batches of ledger calls, bounded memory.
    fn first_with_ledger(
        &mut self,
        inputs: Vec<Input>,
        book: &mut Ledger<'_>,
        out: &mut dyn Write,
    ) -> anyhow::Result<()> {
        let mut records = Records::open(self.format, inputs);
        let mut scratch = Scratch::default();
        let mut header_done = false;
        while let Some(keyed) = records.next(self.spec, self.now_ms, &mut scratch)? {
            self.counts.read += 1;
            self.tick(&records)?;
            if !header_done {
                records.write_header(self.emit_id, out)?;
                header_done = true;
            }
            match keyed {
                Keyed::Rejected(pos, reason, value) => {
                    self.rejects.reject(&pos, &reason.0, value)?
                }
                Keyed::Key(digest) => {
                    if book.first_sighting(&digest) {
                        self.offer(&mut records, &digest, &scratch, book, out)?;
                    } else {
                        self.counts.duplicates += 1;
                    }
                }
            }
        }
        if !header_done {
            records.write_header(self.emit_id, out)?;
        }
        Ok(())
    }

    /// Puts one record into the ledger's batch.
    fn offer(
        &mut self,
        records: &mut Records,
        digest: &[u8; 32],
        scratch: &Scratch,
        book: &mut Ledger<'_>,
        out: &mut dyn Write,
    ) -> anyhow::Result<()> {
        let spec = self.spec;
        let emit_id = self.emit_id;
        book.push(
            digest,
            || spec.ledger_key(digest, scratch),
            |buf| {
                let hex;
                let id = match emit_id {
                    Some(f) => {
                        hex = hex::encode(digest);
                        Some((f, hex.as_str()))
                    }
                    None => None,
                };
                records.encode(id, buf)
            },
            &mut self.counts,
            out,
        )
    }

    /// Keep last: pass 1 finds each key's last record, pass 2 emits those (through the ledger
    /// when there is one).
    fn last(
        &mut self,
        inputs: Vec<Input>,
        mut book: Option<&mut Ledger<'_>>,
        out: &mut dyn Write,
    ) -> anyhow::Result<()> {
        let mut last: std::collections::HashMap<u128, u64, Prehashed> = Default::default();
        let mut scratch = Scratch::default();
        let mut records = Records::open(self.format, inputs.clone());
        let mut index = 0u64;
        while let Some(keyed) = records.next(self.spec, self.now_ms, &mut scratch)? {
            self.counts.read += 1;
            self.tick(&records)?;
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
            check_interrupt(self.interrupted)?;
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
            match book.as_deref_mut() {
                // Each key's last record is offered once, so the window never holds it back.
                Some(book) => {
                    if book.first_sighting(&digest) {
                        self.offer(&mut records, &digest, &scratch, book, out)?;
                    } else {
                        self.counts.duplicates += 1;
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
