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
use dedupgate_core::keys::KeyFields;

use super::pipeline::input::{self, Format, Input};
use super::pipeline::keyspec::{KeySpec, Scratch};
use super::pipeline::records::{Keyed, Records};
use super::pipeline::{now_ms, progress, Rejects, PROGRESS_EVERY_LINES};

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
    /// No progress bar.
    #[arg(short, long)]
    quiet: bool,
}

/// Runs `dedupgate id`.
pub fn run(args: IdArgs) -> anyhow::Result<ExitCode> {
    let fields = KeyFields::parse(&args.key_fields)
        .with_context(|| format!("--key-fields {:?}", args.key_fields))?;
    let spec = KeySpec::Fields(fields);
    let inputs = Input::from_args(&args.inputs);
    let format = Format::resolve(args.format, &inputs)?;
    let mut rejects = Rejects::open(args.rejects.as_deref())?;
    let bar = progress(input::total_bytes(&inputs), args.quiet);
    let mut out = input::open_output(args.output.as_deref())?;
    let mut records = Records::open(format, inputs);
    let mut scratch = Scratch::default();
    let now = now_ms();
    let mut read = 0u64;
    let mut header_done = args.print;
    let mut hex = String::with_capacity(64);
    while let Some(keyed) = records.next(&spec, now, &mut scratch)? {
        read += 1;
        if read % PROGRESS_EVERY_LINES == 0 {
            bar.set_position(records.bytes_read());
        }
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
            }
        }
    }
    if !header_done {
        records.write_header(Some(&args.emit_id), &mut *out)?;
    }
    bar.finish_and_clear();
    out.flush().context("writing the output")?;
    rejects.finish()?;
    Ok(ExitCode::SUCCESS)
}
