//! `dedupgate id`: adds each record's deterministic id (API.md "Deterministic ids": the hex
//! SHA-256 of Python's `json.dumps({f: r[f] for f in F}, sort_keys=True)`) under a field, the
//! record otherwise unchanged byte for byte; or, with `--print`, prints only the ids.
//!
//! Exit codes: 0 done; 1 failed (a record without the key fields and no `--rejects`, I/O);
//! 2 bad usage.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use super::pipeline::input::{self, check_inputs, check_outputs, Format, Input, Output};
use super::pipeline::keyspec::{key_fields, KeySpec, Scratch};
use super::pipeline::records::{Keyed, Records};
use super::pipeline::{
    check_interrupt, interrupt_flag, now_ms, progress, report_failure, summary, usage, Rejects,
    PROGRESS_EVERY_LINES,
};

/// Flags of `dedupgate id`.
#[derive(clap::Args, Debug)]
pub struct IdArgs {
    /// Comma-separated top-level fields (CSV: columns) the id is computed over.
    #[arg(long, value_name = "a,b", required = true)]
    key_fields: String,
    /// The field (CSV: column) the id is written under; an existing one is replaced.
    #[arg(long, value_name = "FIELD", default_value = "id")]
    emit_id: String,
    /// Print only the ids, one per line, instead of the records.
    #[arg(long)]
    print: bool,
    /// Input files (JSON Lines or CSV); none or `-` reads stdin.
    inputs: Vec<PathBuf>,
    /// Output file [default: stdout].
    #[arg(short, long, value_name = "OUT")]
    output: Option<PathBuf>,
    /// Input and output format [default: by extension, else jsonl].
    #[arg(long, value_enum)]
    format: Option<Format>,
    /// Write records without the key fields here and go on; without it the first one stops
    /// the run.
    #[arg(long, value_name = "FILE")]
    rejects: Option<PathBuf>,
    /// No progress bar and no summary line.
    #[arg(short, long)]
    quiet: bool,
}

/// Runs `dedupgate id`: a usage error exits 2, any other failure 1.
pub fn run(args: IdArgs) -> anyhow::Result<ExitCode> {
    Ok(id(args).unwrap_or_else(|e| report_failure("id", &e)))
}

fn id(args: IdArgs) -> anyhow::Result<ExitCode> {
    let started = std::time::Instant::now();
    let spec = KeySpec::Fields(key_fields(&args.key_fields)?);
    let inputs = Input::from_args(&args.inputs);
    if inputs.iter().filter(|i| **i == Input::Stdin).count() > 1 {
        return Err(usage("stdin (-) may be given only once"));
    }
    let format = Format::resolve(args.format, &inputs)?;
    // Nothing is created or truncated before the inputs are known to be readable and no
    // output names an input or another output.
    let mut outputs = vec![Output::of("-o", args.output.as_deref())];
    if let Some(rejects) = &args.rejects {
        outputs.push(Output::File("--rejects", rejects));
    }
    check_outputs(&inputs, &outputs)?;
    check_inputs(&inputs)?;
    let mut rejects = Rejects::open(args.rejects.as_deref())?;
    let bar = progress(input::total_bytes(&inputs), args.quiet);
    let interrupted = interrupt_flag();
    let mut out = input::open_output(args.output.as_deref())?;
    let mut records = Records::open(format, inputs);
    let mut scratch = Scratch::default();
    let now = now_ms();
    let (mut read, mut written) = (0u64, 0u64);
    let mut header_done = args.print;
    let mut hex = String::with_capacity(64);
    let mut each = || -> anyhow::Result<()> {
        while let Some(keyed) = records.next(&spec, now, &mut scratch)? {
            read += 1;
            if read % PROGRESS_EVERY_LINES == 0 {
                bar.set_position(records.bytes_read());
            }
            check_interrupt(&interrupted)?;
            if !header_done {
                records.write_header(Some(&args.emit_id), &mut *out)?;
                header_done = true;
            }
            match keyed {
                Keyed::Rejected(pos, reason, value) => rejects.reject(&pos, &reason.0, value)?,
                Keyed::Key(digest) => {
                    hex.clear();
                    hex.push_str(&hex::encode(digest));
                    if args.print {
                        out.write_all(hex.as_bytes())?;
                        out.write_all(b"\n")?;
                    } else {
                        records.encode(Some((&args.emit_id, &hex)), &mut *out)?;
                    }
                    written += 1;
                }
            }
        }
        if !header_done {
            records.write_header(Some(&args.emit_id), &mut *out)?;
        }
        Ok(())
    };
    let result = each().and_then(|()| out.flush().context("writing the output"));
    bar.finish_and_clear();
    if result
        .as_ref()
        .is_err_and(crate::commands::is_output_closed)
    {
        return result.map(|()| ExitCode::SUCCESS);
    }
    let stopped = result.is_err();
    if stopped {
        // What was written before the stop is flushed and counted, then the reason.
        if let Err(flush) = out.flush() {
            tracing::warn!("while stopping: writing the output: {flush}");
        }
    }
    let finished = result.and_then(|()| rejects.finish());
    if !args.quiet {
        let not_written = read.saturating_sub(written + rejects.count);
        eprintln!(
            "{}",
            summary(
                "id",
                stopped,
                read,
                &[("written", written), ("rejected", rejects.count)],
                &[("not written", not_written)],
                started,
            )
        );
    }
    finished.map(|()| ExitCode::SUCCESS)
}
