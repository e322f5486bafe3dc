//! A stream of records of one format with their keys: [`Records::next`] keys the next record,
//! [`Records::encode`] writes it back out (unchanged but for an optional id field).

use std::io::Write;

use anyhow::{bail, Context};
use dedupgate_core::keys::RawObject;

use super::input::{Format, Input, LineReader, Position};
use super::keyspec::{CsvColumns, KeySpec, Reject, Scratch};
use super::line_value;

/// One keyed record, or why it has no key.
pub enum Keyed {
    /// The record's key digest (its key text is in the scratch).
    Key([u8; 32]),
    /// No key: where and why, and the record as a JSON value for the rejects file.
    Rejected(Position, Reject, serde_json::Value),
}

/// Records of JSON Lines or CSV inputs.
pub enum Records {
    /// JSON Lines.
    Jsonl(JsonlRecords),
    /// CSV.
    Csv(Box<CsvRecords>),
}

/// JSON Lines records.
pub struct JsonlRecords {
    reader: LineReader,
    has_line: bool,
}

/// The CSV input being read: its name, reader and key columns.
type CsvInput = (
    String,
    csv::Reader<Box<dyn std::io::Read + Send>>,
    CsvColumns,
);

/// CSV records.
pub struct CsvRecords {
    inputs: Vec<Input>,
    next_input: usize,
    current: Option<CsvInput>,
    /// The header of the first input: every later input must have the same.
    header: Option<csv::StringRecord>,
    bytes_done: u64,
    raw: csv::ByteRecord,
    row: csv::StringRecord,
    /// Encodes one row at a time into `encoded`.
    encoder: csv::Writer<SharedBuf>,
    encoded: SharedBuf,
    scratch_row: csv::StringRecord,
    position: Position,
}

impl Records {
    /// Records of `inputs` in `format`.
    pub fn open(format: Format, inputs: Vec<Input>) -> Self {
        match format {
            Format::Jsonl => Records::Jsonl(JsonlRecords {
                reader: LineReader::new(inputs),
                has_line: false,
            }),
            Format::Csv => {
                let encoded = SharedBuf::default();
                Records::Csv(Box::new(CsvRecords {
                    inputs,
                    next_input: 0,
                    current: None,
                    header: None,
                    bytes_done: 0,
                    raw: csv::ByteRecord::new(),
                    row: csv::StringRecord::new(),
                    encoder: csv::WriterBuilder::new()
                        .has_headers(false)
                        .from_writer(encoded.clone()),
                    encoded,
                    scratch_row: csv::StringRecord::new(),
                    position: Position {
                        file: String::new(),
                        line: 0,
                    },
                }))
            }
        }
    }

    /// Bytes read so far (for the progress bar).
    pub fn bytes_read(&self) -> u64 {
        match self {
            Records::Jsonl(j) => j.reader.bytes_read(),
            Records::Csv(c) => {
                c.bytes_done
                    + c.current
                        .as_ref()
                        .map_or(0, |(_, r, _)| r.position().byte())
            }
        }
    }

    /// Where the current record is.
    pub fn position(&self) -> Position {
        match self {
            Records::Jsonl(j) => j.reader.position(),
            Records::Csv(c) => c.position.clone(),
        }
    }

    /// Keys the next record; `None` at the end of the inputs.
    pub fn next(
        &mut self,
        spec: &KeySpec,
        now_ms: i64,
        scratch: &mut Scratch,
    ) -> anyhow::Result<Option<Keyed>> {
        match self {
            Records::Jsonl(j) => {
                j.has_line = false;
                if j.reader.next_line()?.is_none() {
                    return Ok(None);
                }
                let line = j.reader.current_line();
                let keyed = match spec.digest_json(line, now_ms, scratch) {
                    Ok(d) => Keyed::Key(d),
                    Err(r) => Keyed::Rejected(j.reader.position(), r, line_value(line)),
                };
                j.has_line = true;
                Ok(Some(keyed))
            }
            Records::Csv(c) => c.next(spec, now_ms, scratch),
        }
    }

    /// The text of a top-level field of the current record (for `--window-field`): a string's
    /// value, or a number's digits.
    pub fn field_text(&self, name: &str) -> Option<String> {
        match self {
            Records::Jsonl(j) => {
                let line = std::str::from_utf8(j.reader.current_line()).ok()?;
                let obj = RawObject::parse(line).ok()?;
                let raw = obj.get(name)?;
                match serde_json::from_str::<serde_json::Value>(raw.get()).ok()? {
                    serde_json::Value::String(s) => Some(s),
                    serde_json::Value::Number(n) => Some(n.to_string()),
                    _ => None,
                }
            }
            Records::Csv(c) => {
                let (_, _, cols) = c.current.as_ref()?;
                let i = cols.headers().iter().rposition(|h| h == name)?;
                c.row.get(i).map(str::to_owned)
            }
        }
    }

    /// Writes the header, if the format has one (CSV), with `id_field` added when given.
    /// Call after the first [`Records::next`] (the header is read with the first row).
    pub fn write_header(
        &mut self,
        id_field: Option<&str>,
        out: &mut dyn Write,
    ) -> anyhow::Result<()> {
        if let Records::Csv(c) = self {
            if let Some(header) = c.header.clone() {
                let mut h = header;
                if let Some(f) = id_field {
                    if !h.iter().any(|x| x == f) {
                        h.push_field(f);
                    }
                }
                c.encoder.write_record(&h)?;
                c.encoder.flush()?;
                c.encoded.drain_to(out)?;
            }
        }
        Ok(())
    }

    /// Writes the current record, unchanged but for `id` set under its field when given.
    pub fn encode(&mut self, id: Option<(&str, &str)>, out: &mut dyn Write) -> anyhow::Result<()> {
        match self {
            Records::Jsonl(j) => {
                debug_assert!(j.has_line);
                let line = j.reader.current_line();
                match id {
                    None => {
                        out.write_all(line)?;
                    }
                    Some((field, value)) => {
                        let text = std::str::from_utf8(line).context("record is not UTF-8")?;
                        let obj = RawObject::parse(text)?;
                        out.write_all(obj.with_string_field(field, value).as_bytes())?;
                    }
                }
                out.write_all(b"\n")?;
            }
            Records::Csv(c) => {
                let row = match id {
                    None => &c.row,
                    Some((field, value)) => {
                        c.scratch_row.clear();
                        let cols = c.current.as_ref().map(|(_, _, cols)| cols.headers());
                        let at = cols.and_then(|h| h.iter().position(|x| x == field));
                        for (i, cell) in c.row.iter().enumerate() {
                            c.scratch_row
                                .push_field(if Some(i) == at { value } else { cell });
                        }
                        if at.is_none() {
                            c.scratch_row.push_field(value);
                        }
                        &c.scratch_row
                    }
                };
                c.encoder.write_record(row)?;
                c.encoder.flush()?;
                c.encoded.drain_to(out)?;
            }
        }
        Ok(())
    }
}

impl CsvRecords {
    fn next(
        &mut self,
        spec: &KeySpec,
        now_ms: i64,
        scratch: &mut Scratch,
    ) -> anyhow::Result<Option<Keyed>> {
        loop {
            if self.current.is_none() {
                let Some(input) = self.inputs.get(self.next_input) else {
                    return Ok(None);
                };
                self.next_input += 1;
                let name = input.name();
                let mut reader = csv::ReaderBuilder::new()
                    .has_headers(true)
                    .flexible(true)
                    .buffer_capacity(super::input::READ_BUFFER_BYTES)
                    .from_reader(input.open()?);
                let header = match reader.headers() {
                    Ok(h) => h.clone(),
                    Err(e) => bail!("{name}: cannot read the CSV header: {e}"),
                };
                if header.is_empty() {
                    // An empty file: no header, no rows.
                    continue;
                }
                match &self.header {
                    None => self.header = Some(header.clone()),
                    Some(first) if *first != header => bail!(
                        "{name}: its CSV header differs from the first input's ({:?} vs {:?})",
                        header.iter().collect::<Vec<_>>(),
                        first.iter().collect::<Vec<_>>()
                    ),
                    Some(_) => {}
                }
                let cols = CsvColumns::new(spec, &header, &name)?;
                self.current = Some((name, reader, cols));
            }
            let (name, reader, cols) = self.current.as_mut().expect("set above");
            let more = reader
                .read_byte_record(&mut self.raw)
                .with_context(|| format!("reading CSV {name}"))?;
            if !more {
                self.bytes_done += reader.position().byte();
                self.current = None;
                continue;
            }
            let pos = Position {
                file: name.clone(),
                line: self.raw.position().map_or(0, |p| p.line()),
            };
            self.position = pos.clone();
            match csv::StringRecord::from_byte_record(self.raw.clone()) {
                Ok(row) => self.row = row,
                Err(e) => {
                    let cells: Vec<serde_json::Value> = self.raw.iter().map(line_value).collect();
                    return Ok(Some(Keyed::Rejected(
                        pos,
                        Reject(format!("not UTF-8: {e}")),
                        serde_json::Value::Array(cells),
                    )));
                }
            }
            return Ok(Some(
                match spec.digest_csv(cols, &self.row, now_ms, scratch) {
                    Ok(d) => Keyed::Key(d),
                    Err(r) => {
                        let cells = self
                            .row
                            .iter()
                            .map(|s| serde_json::Value::String(s.to_owned()))
                            .collect();
                        Keyed::Rejected(pos, r, serde_json::Value::Array(cells))
                    }
                },
            ));
        }
    }
}

/// A byte buffer the CSV encoder writes into and the caller drains after each row.
#[derive(Clone, Default)]
pub struct SharedBuf(std::rc::Rc<std::cell::RefCell<Vec<u8>>>);

impl SharedBuf {
    /// Moves the bytes written so far to `out`.
    fn drain_to(&self, out: &mut dyn Write) -> std::io::Result<()> {
        let mut buf = self.0.borrow_mut();
        let written = out.write_all(&buf);
        buf.clear();
        written
    }
}

impl Write for SharedBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.borrow_mut().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
