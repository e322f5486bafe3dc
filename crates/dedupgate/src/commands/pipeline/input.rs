//! Reading records: JSON Lines or CSV, from files or stdin, with file names and line numbers
//! kept for error messages and rejects.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use super::usage;
use crate::commands::ClosedAware;

/// Read buffer per input: large enough that a read is a few hundred lines.
pub const READ_BUFFER_BYTES: usize = 1 << 20;
/// Write buffer of the output.
pub const WRITE_BUFFER_BYTES: usize = 1 << 20;

/// A record format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// JSON Lines: one JSON object per line.
    Jsonl,
    /// CSV with a header row.
    Csv,
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Format::Jsonl => "JSON Lines",
            Format::Csv => "CSV",
        })
    }
}

impl Format {
    /// The format an extension names, if any.
    pub fn of_path(path: &Path) -> Option<Format> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "jsonl" | "ndjson" | "json" | "jsonlines" => Some(Format::Jsonl),
            "csv" => Some(Format::Csv),
            _ => None,
        }
    }

    /// The format to use: `--format`, else the inputs' extensions (which must agree), else
    /// JSON Lines.
    pub fn resolve(flag: Option<Format>, inputs: &[Input]) -> anyhow::Result<Format> {
        if let Some(f) = flag {
            return Ok(f);
        }
        let mut found: Option<(Format, &Path)> = None;
        for input in inputs {
            if let Input::File(path) = input {
                if let Some(f) = Format::of_path(path) {
                    match found {
                        Some((g, first)) if g != f => {
                            return Err(usage(format!(
                                "inputs mix formats ({} is {g}, {} is {f}); give --format",
                                first.display(),
                                path.display()
                            )))
                        }
                        _ => found = Some((f, path)),
                    }
                }
            }
        }
        Ok(found.map_or(Format::Jsonl, |(f, _)| f))
    }
}

/// One input: a file or stdin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// Standard input (`-` or no input given).
    Stdin,
    /// A file.
    File(PathBuf),
    /// A temporary file holding what came from elsewhere (stdin spooled for a second pass, the
    /// rows of a PostgreSQL query), read from `path` but named `name` in messages and rejects.
    Spooled {
        /// The temporary file.
        path: PathBuf,
        /// What it holds, e.g. `<stdin>`.
        name: String,
    },
}

impl Input {
    /// Inputs from the command line; none means stdin.
    pub fn from_args(paths: &[PathBuf]) -> Vec<Input> {
        if paths.is_empty() {
            return vec![Input::Stdin];
        }
        paths
            .iter()
            .map(|p| {
                if p.as_os_str() == "-" {
                    Input::Stdin
                } else {
                    Input::File(p.clone())
                }
            })
            .collect()
    }

    /// The name used in messages.
    pub fn name(&self) -> String {
        match self {
            Input::Stdin => "<stdin>".to_owned(),
            Input::File(p) => p.display().to_string(),
            Input::Spooled { name, .. } => name.clone(),
        }
    }

    /// Opens the input for reading.
    pub fn open(&self) -> anyhow::Result<Box<dyn Read + Send>> {
        Ok(match self {
            Input::Stdin => Box::new(io::stdin()),
            Input::File(p) => Box::new(
                File::open(p).with_context(|| format!("cannot open input {}", p.display()))?,
            ),
            Input::Spooled { path, name } => Box::new(
                File::open(path)
                    .with_context(|| format!("cannot open the spool file of {name}"))?,
            ),
        })
    }

    /// Size in bytes, when known (for the progress bar).
    pub fn len_bytes(&self) -> Option<u64> {
        match self {
            Input::Stdin => None,
            Input::File(p) | Input::Spooled { path: p, .. } => {
                std::fs::metadata(p).ok().map(|m| m.len())
            }
        }
    }
}

/// Total size of the inputs when every one is a file.
pub fn total_bytes(inputs: &[Input]) -> Option<u64> {
    inputs.iter().map(Input::len_bytes).sum()
}

/// Checks that every input file can be opened and is not a directory, so that a run that
/// cannot read its inputs fails before it creates (truncates) any output.
pub fn check_inputs(inputs: &[Input]) -> anyhow::Result<()> {
    for input in inputs {
        if let Input::File(p) = input {
            let cannot = || format!("cannot open input {}", p.display());
            let meta = std::fs::metadata(p).with_context(cannot)?;
            if meta.is_dir() {
                bail!("cannot open input {}: it is a directory", p.display());
            }
            // A FIFO is not opened here: opening and closing it would disturb its writer.
            if meta.is_file() {
                File::open(p).with_context(cannot)?;
            }
        }
    }
    Ok(())
}

/// An output of a command, for [`check_outputs`].
pub enum Output<'a> {
    /// Standard output.
    Stdout,
    /// A file given with a flag (`-o`, `--rejects`).
    File(&'static str, &'a Path),
}

impl<'a> Output<'a> {
    /// The output of `flag` (e.g. `-o`): `None` or `-` is stdout.
    pub fn of(flag: &'static str, path: Option<&'a Path>) -> Self {
        match path {
            Some(p) if p.as_os_str() != "-" => Output::File(flag, p),
            _ => Output::Stdout,
        }
    }

    fn label(&self) -> String {
        match self {
            Output::Stdout => "stdout".to_owned(),
            Output::File(flag, p) => format!("{flag} {}", p.display()),
        }
    }

    /// The identity of the file written, when it is a regular file or does not exist yet
    /// (devices such as `/dev/null` may be shared), else `None`.
    fn id(&self) -> Option<FileId> {
        match self {
            Output::Stdout => stdio_id(&io::stdout()),
            Output::File(_, p) => match std::fs::metadata(p) {
                Ok(meta) if meta.is_file() => Some(FileId::of(p, &meta)),
                Ok(_) => None,
                Err(_) => Some(FileId::Path(absolute(p))),
            },
        }
    }
}

/// Identity of a file: device and inode when it exists (so a symlink, a hard link or another
/// spelling of a path is the same file), else its absolute path.
#[derive(Debug, PartialEq, Eq)]
enum FileId {
    #[cfg(unix)]
    Inode(u64, u64),
    Path(PathBuf),
}

impl FileId {
    #[cfg(unix)]
    fn of(_path: &Path, meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        FileId::Inode(meta.dev(), meta.ino())
    }

    #[cfg(not(unix))]
    fn of(path: &Path, _meta: &std::fs::Metadata) -> Self {
        FileId::Path(absolute(path))
    }
}

/// `path` made absolute with its parent directory resolved (symlinks and `..`), for a file
/// that may not exist yet.
fn absolute(path: &Path) -> PathBuf {
    if let Ok(p) = std::fs::canonicalize(path) {
        return p;
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let parent = std::fs::canonicalize(&parent).unwrap_or(parent);
    match path.file_name() {
        Some(name) => parent.join(name),
        None => parent,
    }
}

/// The identity of the regular file stdin or stdout is redirected to, if it is one.
#[cfg(unix)]
fn stdio_id(stream: &impl std::os::fd::AsFd) -> Option<FileId> {
    let fd = stream.as_fd().try_clone_to_owned().ok()?;
    let meta = File::from(fd).metadata().ok()?;
    meta.is_file().then(|| FileId::of(Path::new(""), &meta))
}

#[cfg(not(unix))]
fn stdio_id<T>(_stream: &T) -> Option<FileId> {
    None
}

/// Refuses, as a usage error, outputs that would overwrite an input or each other: an output
/// file is created (truncated) before the inputs are read, so `-o in.jsonl` over the input
/// `in.jsonl` would destroy it. Files are compared by device and inode, so a symlink, a hard
/// link or `./in.jsonl` is caught; stdin and stdout count when redirected to a regular file.
pub fn check_outputs(inputs: &[Input], outputs: &[Output<'_>]) -> anyhow::Result<()> {
    let mut input_ids = Vec::new();
    for input in inputs {
        let id = match input {
            Input::Stdin => stdio_id(&io::stdin()),
            Input::File(p) => std::fs::metadata(p).ok().map(|m| FileId::of(p, &m)),
            Input::Spooled { .. } => None,
        };
        if let Some(id) = id {
            input_ids.push((input, id));
        }
    }
    let mut seen: Vec<(&Output<'_>, FileId)> = Vec::new();
    for output in outputs {
        let Some(id) = output.id() else { continue };
        if let Some((input, _)) = input_ids.iter().find(|(_, i)| *i == id) {
            let input = match input {
                Input::Stdin => "stdin (redirected from that file)".to_owned(),
                other => other.name(),
            };
            return Err(usage(format!(
                "{} is the input {input}: writing there would destroy the input; write to another file",
                output.label()
            )));
        }
        if let Some((other, _)) = seen.iter().find(|(_, o)| *o == id) {
            return Err(usage(format!(
                "{} and {} are the same file; give each its own",
                other.label(),
                output.label()
            )));
        }
        seen.push((output, id));
    }
    Ok(())
}

/// Refuses, as a usage error, an output file inside `store_dir`, the embedded store a run
/// keeps its ledger in: writing there would truncate the store's own files.
pub fn check_outputs_outside(store_dir: &Path, outputs: &[Output<'_>]) -> anyhow::Result<()> {
    let store_dir = absolute(store_dir);
    for output in outputs {
        if let Output::File(_, path) = output {
            if absolute(path).starts_with(&store_dir) {
                return Err(usage(format!(
                    "{} is inside the ledger's store directory {}: writing there would damage \
                     the ledger; write to another place",
                    output.label(),
                    store_dir.display()
                )));
            }
        }
    }
    Ok(())
}

/// Opens the output: a file (created or truncated) or stdout, buffered; a reader that closes
/// it makes writes fail with [`crate::commands::OutputClosed`].
pub fn open_output(path: Option<&Path>) -> anyhow::Result<Box<dyn Write>> {
    Ok(match path {
        Some(p) if p.as_os_str() != "-" => Box::new(io::BufWriter::with_capacity(
            WRITE_BUFFER_BYTES,
            ClosedAware(
                File::create(p).with_context(|| format!("cannot create output {}", p.display()))?,
            ),
        )),
        _ => Box::new(io::BufWriter::with_capacity(
            WRITE_BUFFER_BYTES,
            ClosedAware(io::stdout()),
        )),
    })
}

/// Where a line came from.
#[derive(Clone, Debug)]
pub struct Position {
    /// Input name.
    pub file: String,
    /// 1-based line number in that input.
    pub line: u64,
}

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.file, self.line)
    }
}

/// Reads the lines of several inputs in order. Lines are handed out as bytes without the
/// line ending; blank lines are skipped (they hold no record).
pub struct LineReader {
    inputs: Vec<Input>,
    next_input: usize,
    current: Option<(String, Box<dyn BufRead + Send>)>,
    line_no: u64,
    bytes_read: u64,
    buf: Vec<u8>,
}

impl LineReader {
    /// A reader over `inputs`.
    pub fn new(inputs: Vec<Input>) -> Self {
        Self {
            inputs,
            next_input: 0,
            current: None,
            line_no: 0,
            bytes_read: 0,
            buf: Vec::with_capacity(4096),
        }
    }

    /// Bytes read so far over all inputs.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    /// The position of the line last returned.
    pub fn position(&self) -> Position {
        Position {
            file: self
                .current
                .as_ref()
                .map_or_else(String::new, |(name, _)| name.clone()),
            line: self.line_no,
        }
    }

    /// The line last returned by [`LineReader::next_line`], without its line ending.
    pub fn current_line(&self) -> &[u8] {
        let mut end = self.buf.len();
        while end > 0 && matches!(self.buf[end - 1], b'\n' | b'\r') {
            end -= 1;
        }
        &self.buf[..end]
    }

    /// The next non-blank line, or `None` at the end of the last input.
    pub fn next_line(&mut self) -> anyhow::Result<Option<&[u8]>> {
        loop {
            if self.current.is_none() {
                let Some(input) = self.inputs.get(self.next_input) else {
                    return Ok(None);
                };
                let reader = BufReader::with_capacity(READ_BUFFER_BYTES, input.open()?);
                self.current = Some((input.name(), Box::new(reader)));
                self.next_input += 1;
                self.line_no = 0;
            }
            let (name, reader) = self.current.as_mut().expect("set above");
            self.buf.clear();
            let n = reader
                .read_until(b'\n', &mut self.buf)
                .with_context(|| format!("reading {name}"))?;
            if n == 0 {
                self.current = None;
                continue;
            }
            self.bytes_read += n as u64;
            self.line_no += 1;
            let mut end = self.buf.len();
            while end > 0 && matches!(self.buf[end - 1], b'\n' | b'\r') {
                end -= 1;
            }
            if self.buf[..end].iter().all(|b| matches!(b, b' ' | b'\t')) {
                continue;
            }
            return Ok(Some(&self.buf[..end]));
        }
    }
}

/// Copies stdin to a temporary file so a second pass can read it again (`--keep last`).
pub fn spool_stdin(inputs: Vec<Input>) -> anyhow::Result<(Vec<Input>, Option<tempfile::TempPath>)> {
    if !inputs.contains(&Input::Stdin) {
        return Ok((inputs, None));
    }
    if inputs.iter().filter(|i| **i == Input::Stdin).count() > 1 {
        return Err(usage("stdin (-) may be given only once"));
    }
    let mut file = tempfile::NamedTempFile::new().context("creating a spool file for stdin")?;
    io::copy(&mut io::stdin().lock(), &mut file).context("spooling stdin")?;
    file.flush()?;
    let path = file.into_temp_path();
    let inputs = inputs
        .into_iter()
        .map(|i| match i {
            Input::Stdin => Input::Spooled {
                path: path.to_path_buf(),
                name: Input::Stdin.name(),
            },
            other => other,
        })
        .collect();
    Ok((inputs, Some(path)))
}
