//! `dedupgate audit`: duplicate monitoring. Counts rows and distinct keys of files (JSON Lines
//! or CSV) or of a PostgreSQL table or query, lists the most duplicated keys, and exits 1 when
//! any key occurs more than once. With `--against SOURCE` it reconciles a destination with its
//! source instead: per key, and per time window with `--window-field ts --window 1h`, it lists
//! where the destination holds more rows than the source, and exits 1 when anything does.
//!
//! Exit codes: 0 no duplicates (or nothing over the source); 1 duplicates found; 2 the audit
//! could not be done (bad flags, unreadable input, database error).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use dedupgate_core::keys::{format_rfc3339_ms, parse_duration_ms, parse_timestamp_ms};
use serde_json::json;

use super::pipeline::input::{check_inputs, check_outputs, Format, Input, Output};
use super::pipeline::keyspec::{KeyArgs, KeySpec, Scratch};
use super::pipeline::records::{Keyed, Records};
use super::pipeline::{
    check_interrupt, input, interrupt_flag, now_ms, progress, runtime, summary, usage, Interrupted,
    Rejects, EXIT_INTERRUPTED, PROGRESS_EVERY_LINES,
};
use super::{ClosedAware, OutputClosed};

/// Rejected records shown as examples in the report.
const REJECT_SAMPLES_MAX: usize = 5;
/// Rows fetched from PostgreSQL per round trip (bounded memory).
#[cfg(feature = "postgres")]
const PG_ROWS_PER_FETCH: usize = 10_000;

/// Flags of `dedupgate audit`.
#[derive(clap::Args, Debug)]
pub struct AuditArgs {
    #[command(flatten)]
    key: KeyArgs,
    /// Files to audit (the destination, with --against); none or `-` reads stdin.
    inputs: Vec<PathBuf>,
    /// Input format [default: by extension, else jsonl].
    #[arg(long, value_enum)]
    format: Option<Format>,
    /// Read rows from PostgreSQL at URL (with --query or --table) instead of files.
    #[arg(long, value_name = "URL", env = "DEDUPGATE_AUDIT_POSTGRES")]
    postgres: Option<String>,
    /// SQL whose rows are audited (each row's columns are its fields).
    #[arg(
        long,
        value_name = "SQL",
        conflicts_with = "table",
        requires = "postgres"
    )]
    query: Option<String>,
    /// A table to audit (schema.table).
    #[arg(long, value_name = "NAME", requires = "postgres")]
    table: Option<String>,
    /// The source the destination is reconciled with: a file (repeat for more).
    #[arg(long, value_name = "SOURCE", group = "source")]
    against: Vec<PathBuf>,
    /// The source as SQL on --postgres.
    #[arg(
        long,
        value_name = "SQL",
        requires = "postgres",
        conflicts_with = "against",
        group = "source"
    )]
    against_query: Option<String>,
    /// The source as a table on --postgres.
    #[arg(long, value_name = "NAME", requires = "postgres", conflicts_with_all = ["against", "against_query"], group = "source")]
    against_table: Option<String>,
    /// Field holding each record's time (RFC 3339 or epoch seconds/ms), for per-window counts
    /// of a reconciliation (needs --against, --against-query or --against-table).
    #[arg(long, value_name = "FIELD", requires_all = ["window", "source"])]
    window_field: Option<String>,
    /// Window length for per-window counts (e.g. 1h).
    #[arg(long, value_name = "D", requires = "window_field")]
    window: Option<String>,
    /// How many duplicated keys (or keys over the source, or missing from the destination) the
    /// table lists; --json lists every missing key.
    #[arg(long, default_value_t = 10, value_name = "N")]
    top: usize,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Also write every rejected record here (JSON Lines).
    #[arg(long, value_name = "FILE")]
    rejects: Option<PathBuf>,
    /// No progress bar and no summary line.
    #[arg(short, long)]
    quiet: bool,
}

/// What the audit read, for its summary line: every record read is counted or rejected.
#[derive(Default)]
struct Seen {
    read: u64,
    counted: u64,
    rejected: u64,
}

/// Counts of one side.
#[derive(Default)]
struct Tally {
    rows: u64,
    keys: HashMap<String, u64>,
    windows: BTreeMap<i64, u64>,
    rejected: u64,
    samples: Vec<String>,
}

/// Runs `dedupgate audit`.
pub fn run(args: AuditArgs) -> anyhow::Result<ExitCode> {
    let started = std::time::Instant::now();
    let quiet = args.quiet;
    let mut seen = Seen::default();
    let mut read_any = false;
    let result = audit(args, &mut seen, &mut read_any);
    // No summary before the inputs were read, nor after the report's reader closed stdout.
    if !quiet && read_any {
        eprintln!(
            "{}",
            summary(
                "audit",
                result.is_err(),
                seen.read,
                &[("counted", seen.counted), ("rejected", seen.rejected)],
                &[(
                    "not counted",
                    seen.read.saturating_sub(seen.counted + seen.rejected),
                )],
                started,
            )
        );
    }
    match result {
        Ok(code) => Ok(code),
        Err(e) if e.downcast_ref::<Interrupted>().is_some() => {
            eprintln!("dedupgate audit: {e}");
            Ok(ExitCode::from(EXIT_INTERRUPTED))
        }
        Err(e) => {
            // Any failure, not only a usage error: exit 1 means duplicates were found.
            eprintln!("dedupgate audit: {e:#}");
            Ok(ExitCode::from(2))
        }
    }
}

fn audit(args: AuditArgs, seen: &mut Seen, read_any: &mut bool) -> anyhow::Result<ExitCode> {
    let spec = args.key.spec()?;
    let window = match (&args.window_field, &args.window) {
        (Some(f), Some(w)) => Some((f.clone(), parse_duration_ms(w).context("--window")?)),
        _ => None,
    };
    let dest_sql = sql_of(args.query.as_deref(), args.table.as_deref())?;
    let source_sql = sql_of(args.against_query.as_deref(), args.against_table.as_deref())?;
    if let Some(url) = &args.postgres {
        // An explicit --postgres that nothing reads from would audit stdin or the files
        // instead, silently; a URL from the environment is only a default.
        let from_env = std::env::var("DEDUPGATE_AUDIT_POSTGRES").is_ok_and(|v| v == *url);
        if dest_sql.is_none() && source_sql.is_none() && !from_env {
            return Err(usage(
                "--postgres needs --query SQL or --table NAME (or --against-query / --against-table) to say what to read",
            ));
        }
    }
    if dest_sql.is_some() && args.postgres.is_some() && !args.inputs.is_empty() {
        return Err(usage("give files or --query/--table, not both"));
    }
    let dest_files = match (&dest_sql, &args.postgres) {
        (Some(_), Some(_)) => None,
        _ => Some(Input::from_args(&args.inputs)),
    };
    let source_files = match (&source_sql, &args.postgres) {
        (Some(_), Some(_)) => None,
        _ if !args.against.is_empty() => Some(Input::from_args(&args.against)),
        _ => None,
    };
    // The rejects file is created only once every input is known to be readable (and the
    // database has answered), and never over an input.
    let all_files: Vec<Input> = dest_files
        .iter()
        .chain(source_files.iter())
        .flatten()
        .cloned()
        .collect();
    if let Some(path) = &args.rejects {
        check_outputs(&all_files, &[Output::File("--rejects", path)])?;
    }
    check_inputs(&all_files)?;

    let rt = runtime()?;
    let mut temps = Vec::new();
    let mut fetch = |sql: &str, name: String| -> anyhow::Result<Vec<Input>> {
        let url = args.postgres.as_deref().unwrap_or_default();
        let path = rt.block_on(fetch_pg(url, sql))?;
        let inputs = vec![Input::Spooled {
            path: path.to_path_buf(),
            name,
        }];
        temps.push(path);
        Ok(inputs)
    };
    let (dest_inputs, dest_format) = match (dest_files, &dest_sql) {
        (Some(inputs), _) => {
            let format = Format::resolve(args.format, &inputs)?;
            (inputs, format)
        }
        (None, sql) => {
            let sql = sql.as_deref().unwrap_or_default();
            let name = pg_name("--query", args.query.is_some(), "--table", &args.table);
            (fetch(sql, name)?, Format::Jsonl)
        }
    };
    let source_inputs = match (source_files, &source_sql, &args.postgres) {
        (Some(inputs), _, _) => {
            let format = Format::resolve(args.format, &inputs)?;
            Some((inputs, format))
        }
        (None, Some(sql), Some(_)) => {
            let name = pg_name(
                "--against-query",
                args.against_query.is_some(),
                "--against-table",
                &args.against_table,
            );
            Some((fetch(sql, name)?, Format::Jsonl))
        }
        _ => None,
    };

    let mut rejects = Rejects::open(args.rejects.as_deref())?;
    let interrupted = interrupt_flag();
    *read_any = true;
    let mut reading = Reading {
        spec: &spec,
        window: window.as_ref(),
        rejects: &mut rejects,
        seen,
        quiet: args.quiet,
        interrupted: &interrupted,
    };
    let dest = reading.tally(dest_format, dest_inputs)?;
    let source = match source_inputs {
        Some((inputs, format)) => Some(reading.tally(format, inputs)?),
        None => None,
    };
    rejects.finish()?;
    drop(temps);

    let report = Report::new(&dest, source.as_ref(), args.top);
    let mut out = ClosedAware(std::io::BufWriter::new(std::io::stdout().lock()));
    let written = if args.json {
        serde_json::to_writer_pretty(&mut out, &report.json(&dest, source.as_ref(), &window))
            .map_err(std::io::Error::from)
            .and_then(|()| writeln!(out))
    } else {
        report.table(&mut out, &dest, source.as_ref(), &window)
    };
    match written.and_then(|()| out.flush()) {
        // A reader that closed stdout (`| head`) does not change the verdict.
        Err(e) if e.get_ref().is_some_and(|i| i.is::<OutputClosed>()) => {
            *read_any = false;
        }
        other => other.context("writing the report")?,
    }
    Ok(if report.found_problem() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// The name PostgreSQL rows go by in messages and rejects (their line is the row number):
/// `<postgres --query>` or `<postgres --table NAME>`.
fn pg_name(query_flag: &str, is_query: bool, table_flag: &str, table: &Option<String>) -> String {
    match (is_query, table) {
        (false, Some(t)) => format!("<postgres {table_flag} {t}>"),
        _ => format!("<postgres {query_flag}>"),
    }
}

/// The SQL for `--query` or `--table`.
fn sql_of(query: Option<&str>, table: Option<&str>) -> anyhow::Result<Option<String>> {
    Ok(match (query, table) {
        (Some(q), _) => Some(q.trim().trim_end_matches(';').to_owned()),
        (None, Some(t)) => {
            if t.is_empty()
                || !t
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            {
                bail!("table name {t:?} may hold only letters, digits, _ and . (use --query for anything else)");
            }
            Some(format!("SELECT * FROM {t}"))
        }
        (None, None) => None,
    })
}

/// Streams the rows of `sql` as JSON Lines (PostgreSQL's `row_to_json`) into a temporary file,
/// so a table of any size is audited in bounded memory by the same path as a file.
#[cfg(feature = "postgres")]
async fn fetch_pg(url: &str, sql: &str) -> anyhow::Result<tempfile::TempPath> {
    let (mut client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .context("connecting to PostgreSQL")?;
    let conn = tokio::spawn(async move {
        let _ = connection.await;
    });
    let file = tempfile::NamedTempFile::new().context("creating a temporary file")?;
    let mut w = std::io::BufWriter::new(file);
    let tx = client.transaction().await?;
    let wrapped = format!("SELECT row_to_json(q)::text FROM ({sql}) q");
    let portal = tx
        .bind(wrapped.as_str(), &[])
        .await
        .with_context(|| format!("query {sql:?}"))?;
    loop {
        let rows = tx
            .query_portal(&portal, PG_ROWS_PER_FETCH as i32)
            .await
            .with_context(|| format!("query {sql:?}"))?;
        for row in &rows {
            let text: &str = row.try_get(0)?;
            w.write_all(text.as_bytes())?;
            w.write_all(b"\n")?;
        }
        if rows.len() < PG_ROWS_PER_FETCH {
            break;
        }
    }
    tx.commit().await?;
    drop(client);
    let _ = conn.await;
    let file = w.into_inner().map_err(|e| e.into_error())?;
    Ok(file.into_temp_path())
}

/// A build without the PostgreSQL client refuses `--postgres` by the feature it needs, rather
/// than auditing something else.
#[cfg(not(feature = "postgres"))]
async fn fetch_pg(_url: &str, _sql: &str) -> anyhow::Result<tempfile::TempPath> {
    bail!("--postgres needs dedupgate built with the \"postgres\" feature")
}

/// What reading a side needs, and the counts both sides add to.
struct Reading<'a> {
    spec: &'a KeySpec,
    window: Option<&'a (String, u64)>,
    rejects: &'a mut Rejects,
    seen: &'a mut Seen,
    quiet: bool,
    /// Set by SIGINT: the audit stops between records.
    interrupted: &'a std::sync::atomic::AtomicBool,
}

impl Reading<'_> {
    /// Counts one side's records (with a progress bar on a terminal).
    fn tally(&mut self, format: Format, inputs: Vec<Input>) -> anyhow::Result<Tally> {
        let bar = progress(input::total_bytes(&inputs), self.quiet);
        let (before_counted, before_rejected) = (self.seen.counted, self.seen.rejected);
        let mut read = 0u64;
        let result = tally(
            self.spec,
            format,
            inputs,
            self.window,
            self.rejects,
            |records: &Records| {
                read += 1;
                if read % PROGRESS_EVERY_LINES == 0 {
                    bar.set_position(records.bytes_read());
                }
                check_interrupt(self.interrupted)
            },
        );
        bar.finish_and_clear();
        // Counted from the tally when it finished; from the records read when it stopped.
        match &result {
            Ok(t) => {
                self.seen.counted = before_counted + t.rows;
                self.seen.rejected = before_rejected + t.rejected;
                self.seen.read += t.rows + t.rejected;
            }
            Err(_) => self.seen.read += read,
        }
        result
    }
}

fn tally(
    spec: &KeySpec,
    format: Format,
    inputs: Vec<Input>,
    window: Option<&(String, u64)>,
    rejects: &mut Rejects,
    mut tick: impl FnMut(&Records) -> anyhow::Result<()>,
) -> anyhow::Result<Tally> {
    let mut t = Tally::default();
    let mut records = Records::open(format, inputs);
    let mut scratch = Scratch::default();
    let now = now_ms();
    while let Some(keyed) = records.next(spec, now, &mut scratch)? {
        tick(&records)?;
        let mut reject = |pos: &super::pipeline::input::Position,
                          reason: &str,
                          value: serde_json::Value,
                          t: &mut Tally|
         -> anyhow::Result<()> {
            t.rejected += 1;
            if t.samples.len() < REJECT_SAMPLES_MAX {
                t.samples.push(format!("{pos}: {reason}"));
            }
            if rejects.has_file() {
                rejects.reject(pos, reason, value)?;
            }
            Ok(())
        };
        match keyed {
            Keyed::Rejected(pos, reason, value) => reject(&pos, &reason.0, value, &mut t)?,
            Keyed::Key(_) => {
                if let Some((field, window_ms)) = window {
                    let ts = records
                        .field_text(field)
                        .ok_or_else(|| format!("missing window field `{field}`"))
                        .and_then(|s| {
                            parse_timestamp_ms(&s)
                                .map_err(|e| format!("window field `{field}`: {e}"))
                        });
                    match ts {
                        Ok(ms) => {
                            let w = *window_ms as i64;
                            *t.windows.entry(ms.div_euclid(w) * w).or_default() += 1;
                        }
                        Err(reason) => {
                            let pos = records.position();
                            reject(&pos, &reason, serde_json::Value::Null, &mut t)?;
                            continue;
                        }
                    }
                }
                t.rows += 1;
                *t.keys.entry(scratch.text.clone()).or_default() += 1;
            }
        }
    }
    Ok(t)
}

/// What the audit found.
struct Report {
    duplicated_keys: u64,
    extra_copies: u64,
    top: Vec<(String, u64)>,
    /// True with a source (`--against…`).
    reconciling: bool,
    /// Keys whose destination count exceeds the source's: (key, destination, source).
    keys_over: Vec<(String, u64, u64)>,
    keys_over_count: u64,
    /// Keys of the source with no row in the destination: (key, source count), by key.
    keys_missing: Vec<(String, u64)>,
    /// Windows whose destination count exceeds the source's: (start ms, destination, source).
    windows_over: Vec<(i64, u64, u64)>,
    /// `--top`: how many keys a list of the table shows.
    top_max: usize,
}

impl Report {
    fn new(dest: &Tally, source: Option<&Tally>, top: usize) -> Self {
        let dups: Vec<(&String, &u64)> = dest.keys.iter().filter(|(_, c)| **c > 1).collect();
        let duplicated_keys = dups.len() as u64;
        let extra_copies = dups.iter().map(|(_, c)| **c - 1).sum();
        let mut top_keys: Vec<(String, u64)> =
            dups.into_iter().map(|(k, c)| (k.clone(), *c)).collect();
        top_keys.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        top_keys.truncate(top);
        let mut report = Self {
            duplicated_keys,
            extra_copies,
            top: top_keys,
            reconciling: source.is_some(),
            keys_over: Vec::new(),
            keys_over_count: 0,
            keys_missing: Vec::new(),
            windows_over: Vec::new(),
            top_max: top,
        };
        if let Some(src) = source {
            for (k, d) in &dest.keys {
                let s = src.keys.get(k).copied().unwrap_or(0);
                if *d > s {
                    report.keys_over_count += 1;
                    report.keys_over.push((k.clone(), *d, s));
                }
            }
            report.keys_missing = src
                .keys
                .iter()
                .filter(|(k, _)| !dest.keys.contains_key(*k))
                .map(|(k, c)| (k.clone(), *c))
                .collect();
            report.keys_missing.sort();
            report
                .keys_over
                .sort_by(|a, b| (b.1 - b.2).cmp(&(a.1 - a.2)).then_with(|| a.0.cmp(&b.0)));
            report.keys_over.truncate(top);
            for (w, d) in &dest.windows {
                let s = src.windows.get(w).copied().unwrap_or(0);
                if *d > s {
                    report.windows_over.push((*w, *d, s));
                }
            }
        }
        report
    }

    /// Exit 1 when this is true: any duplicate, or, reconciling, anything over the source.
    fn found_problem(&self) -> bool {
        if self.reconciling {
            self.keys_over_count > 0 || !self.windows_over.is_empty()
        } else {
            self.duplicated_keys > 0
        }
    }

    fn json(
        &self,
        dest: &Tally,
        source: Option<&Tally>,
        window: &Option<(String, u64)>,
    ) -> serde_json::Value {
        let mut v = json!({
            "rows": dest.rows,
            "distinct_keys": dest.keys.len(),
            "duplicated_keys": self.duplicated_keys,
            "extra_copies": self.extra_copies,
            "rejected": dest.rejected,
            "reject_samples": dest.samples,
            "top": self.top.iter().map(|(k, c)| json!({"key": k, "count": c})).collect::<Vec<_>>(),
        });
        if let Some(src) = source {
            v["against"] = json!({
                "source_rows": src.rows,
                "source_distinct_keys": src.keys.len(),
                "source_rejected": src.rejected,
                "keys_over_source": self.keys_over_count,
                "keys_missing_from_destination": self.keys_missing.len(),
                "keys_missing": self.keys_missing.iter().map(|(k, s)| json!({"key": k, "source": s})).collect::<Vec<_>>(),
                "keys_over": self.keys_over.iter().map(|(k, d, s)| json!({"key": k, "destination": d, "source": s})).collect::<Vec<_>>(),
                "window_field": window.as_ref().map(|w| w.0.clone()),
                "window_ms": window.as_ref().map(|w| w.1),
                "windows_over": self.windows_over.iter().map(|(w, d, s)| json!({"window": window_name(*w), "destination": d, "source": s})).collect::<Vec<_>>(),
            });
        }
        v
    }

    fn table(
        &self,
        out: &mut dyn Write,
        dest: &Tally,
        source: Option<&Tally>,
        window: &Option<(String, u64)>,
    ) -> std::io::Result<()> {
        let side = if source.is_some() { "destination " } else { "" };
        writeln!(out, "{side}rows              {:>12}", dest.rows)?;
        writeln!(out, "{side}distinct keys     {:>12}", dest.keys.len())?;
        writeln!(out, "{side}duplicated keys   {:>12}", self.duplicated_keys)?;
        writeln!(out, "{side}extra copies      {:>12}", self.extra_copies)?;
        writeln!(out, "{side}rejected          {:>12}", dest.rejected)?;
        for s in &dest.samples {
            writeln!(out, "  rejected: {s}")?;
        }
        if !self.top.is_empty() {
            writeln!(out, "\ntop duplicated keys:")?;
            writeln!(out, "{:>10}  key", "count")?;
            for (k, c) in &self.top {
                writeln!(out, "{c:>10}  {k}")?;
            }
        }
        if let Some(src) = source {
            writeln!(out)?;
            writeln!(out, "source rows              {:>12}", src.rows)?;
            writeln!(out, "source distinct keys     {:>12}", src.keys.len())?;
            writeln!(out, "source rejected          {:>12}", src.rejected)?;
            for s in &src.samples {
                writeln!(out, "  rejected: {s}")?;
            }
            writeln!(out, "keys over source         {:>12}", self.keys_over_count)?;
            writeln!(
                out,
                "keys missing from dest.  {:>12}",
                self.keys_missing.len()
            )?;
            if !self.keys_over.is_empty() {
                writeln!(
                    out,
                    "\nkeys with more rows in the destination than in the source:"
                )?;
                writeln!(out, "{:>10}  {:>10}  key", "dest", "source")?;
                for (k, d, s) in &self.keys_over {
                    writeln!(out, "{d:>10}  {s:>10}  {k}")?;
                }
            }
            if !self.keys_missing.is_empty() {
                writeln!(out, "\nkeys of the source missing from the destination:")?;
                writeln!(out, "{:>10}  key", "source")?;
                for (k, s) in self.keys_missing.iter().take(self.top_max) {
                    writeln!(out, "{s:>10}  {k}")?;
                }
                let rest = self.keys_missing.len().saturating_sub(self.top_max);
                if rest > 0 {
                    writeln!(
                        out,
                        "  … and {rest} more (--top N lists more; --json lists all)"
                    )?;
                }
            }
            if let Some((field, _)) = window {
                writeln!(
                    out,
                    "\nwindows (by `{field}`) with more rows in the destination than in the source: {}",
                    self.windows_over.len()
                )?;
                if !self.windows_over.is_empty() {
                    writeln!(out, "{:<24}  {:>10}  {:>10}", "window", "dest", "source")?;
                    for (w, d, s) in &self.windows_over {
                        writeln!(out, "{:<24}  {d:>10}  {s:>10}", window_name(*w))?;
                    }
                }
            }
        }
        Ok(())
    }
}

fn window_name(start_ms: i64) -> String {
    format_rfc3339_ms(start_ms, start_ms % 1000 != 0).unwrap_or_else(|| start_ms.to_string())
}
