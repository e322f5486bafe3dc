//! What makes two records the same: `--key-fields a,b` (the deterministic id of API.md) or
//! `--key-template T` (a rendered key). Both give a 32-byte digest per record: the id itself
//! for key fields, the SHA-256 of the rendered key for a template.

use anyhow::bail;
use dedupgate_core::keys::{id_bytes, FieldValue, KeyFields, KeyTemplate, RawObject};
use dedupgate_core::Key;
use serde_json::{Map, Value};

use super::usage;

/// The key of the records.
#[derive(Debug, Clone)]
pub enum KeySpec {
    /// Deterministic id over these top-level fields.
    Fields(KeyFields),
    /// A key template.
    Template(KeyTemplate),
}

/// Flags shared by dedup, id and audit.
#[derive(clap::Args, Debug, Clone)]
pub struct KeyArgs {
    /// Comma-separated top-level fields (CSV: columns) whose values make the key; two records
    /// are duplicates when these fields are equal as JSON values (so 1.0 equals 1.00).
    #[arg(long, value_name = "a,b", conflicts_with = "key_template")]
    pub key_fields: Option<String>,
    /// A key template, e.g. '{asset}_{signal}_{ts|window:5m}' (docs/cli.md).
    #[arg(long, value_name = "T")]
    pub key_template: Option<String>,
}

impl KeyArgs {
    /// The key spec the flags give; one of them is required.
    pub fn spec(&self) -> anyhow::Result<KeySpec> {
        match (&self.key_fields, &self.key_template) {
            (Some(f), None) => Ok(KeySpec::Fields(key_fields(f)?)),
            (None, Some(t)) => {
                Ok(KeySpec::Template(KeyTemplate::parse(t).map_err(|e| {
                    usage(format!("--key-template {t:?}: {e}"))
                })?))
            }
            (None, None) => Err(usage("give --key-fields a,b or --key-template T")),
            (Some(_), Some(_)) => Err(usage(
                "give either --key-fields or --key-template, not both",
            )),
        }
    }
}

/// The fields of `--key-fields`; bad ones are a usage error.
pub fn key_fields(text: &str) -> anyhow::Result<KeyFields> {
    KeyFields::parse(text).map_err(|e| usage(format!("--key-fields {text:?}: {e}")))
}

/// Why one record has no key. Goes to the rejects file or stops the run.
#[derive(Debug, Clone)]
pub struct Reject(pub String);

impl std::fmt::Display for Reject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Reusable buffers, so keying a record allocates nothing in the common case.
#[derive(Default)]
pub struct Scratch {
    /// Canonical JSON of the key fields, or the rendered template.
    pub text: String,
}

/// Column indexes of a CSV file's header, for the key fields.
#[derive(Debug, Clone)]
pub struct CsvColumns {
    headers: Vec<String>,
    field_index: Vec<(String, usize)>,
}

impl CsvColumns {
    /// Maps the key fields onto a header row; a key field that is not a column is an error
    /// for the whole file.
    pub fn new(spec: &KeySpec, headers: &csv::StringRecord, file: &str) -> anyhow::Result<Self> {
        let headers: Vec<String> = headers.iter().map(str::to_owned).collect();
        let mut field_index = Vec::new();
        if let KeySpec::Fields(fields) = spec {
            for name in fields.names() {
                // The last column of a repeated name wins, as csv.DictReader does.
                match headers.iter().rposition(|h| h == name) {
                    Some(i) => field_index.push((name.clone(), i)),
                    None => bail!(
                        "{file}: key field `{name}` is not a column (columns: {})",
                        headers.join(", ")
                    ),
                }
            }
        }
        Ok(Self {
            headers,
            field_index,
        })
    }

    /// The header names.
    pub fn headers(&self) -> &[String] {
        &self.headers
    }

    /// The row as a JSON object of strings (for templates and rejects).
    pub fn row_object(&self, row: &csv::StringRecord) -> Value {
        let mut map = Map::new();
        for (h, v) in self.headers.iter().zip(row.iter()) {
            map.insert(h.clone(), Value::String(v.to_owned()));
        }
        Value::Object(map)
    }
}

impl KeySpec {
    /// The digest of a JSON line's key (its text is left in `scratch.text`).
    pub fn digest_json(
        &self,
        line: &[u8],
        now_ms: i64,
        scratch: &mut Scratch,
    ) -> Result<[u8; 32], Reject> {
        let line = std::str::from_utf8(line).map_err(|e| Reject(format!("not UTF-8: {e}")))?;
        match self {
            KeySpec::Fields(fields) => {
                let obj = RawObject::parse(line).map_err(|e| Reject(e.to_string()))?;
                obj.write_canonical_key(fields, &mut scratch.text)
                    .map_err(|e| Reject(e.to_string()))?;
            }
            KeySpec::Template(t) => {
                let v: Value = serde_json::from_str(line)
                    .map_err(|e| Reject(format!("malformed JSON: {e}")))?;
                // A record is an object, whatever the template reads (docs/cli.md): `--emit-id`
                // adds a field to it.
                if !v.is_object() {
                    return Err(Reject("not a JSON object".to_owned()));
                }
                t.render_into(&v, now_ms, &mut scratch.text)
                    .map_err(|e| Reject(e.to_string()))?;
                check_key(&scratch.text)?;
            }
        }
        Ok(id_bytes(&scratch.text))
    }

    /// The digest of a CSV row's key (its text is left in `scratch.text`).
    pub fn digest_csv(
        &self,
        columns: &CsvColumns,
        row: &csv::StringRecord,
        now_ms: i64,
        scratch: &mut Scratch,
    ) -> Result<[u8; 32], Reject> {
        if row.len() != columns.headers.len() {
            return Err(Reject(format!(
                "row has {} fields, the header {}",
                row.len(),
                columns.headers.len()
            )));
        }
        match self {
            KeySpec::Fields(fields) => {
                dedupgate_core::keys::write_canonical_key(
                    fields,
                    |name| {
                        columns
                            .field_index
                            .iter()
                            .find(|(n, _)| n == name)
                            .and_then(|(_, i)| row.get(*i))
                            .map(FieldValue::Text)
                    },
                    &mut scratch.text,
                )
                .map_err(|e| Reject(e.to_string()))?;
            }
            KeySpec::Template(t) => {
                t.render_into(&columns.row_object(row), now_ms, &mut scratch.text)
                    .map_err(|e| Reject(e.to_string()))?;
                check_key(&scratch.text)?;
            }
        }
        Ok(id_bytes(&scratch.text))
    }

    /// The key a ledger stores for a record: the id (hex) for key fields, the rendered key for
    /// a template, so an operator can look it up with `dedupgate get` (a ledger of gate
    /// records) and make it new again with `dedupgate forget` (either kind of ledger).
    pub fn ledger_key(&self, digest: &[u8; 32], scratch: &Scratch) -> String {
        match self {
            KeySpec::Fields(_) => hex::encode(digest),
            KeySpec::Template(_) => scratch.text.clone(),
        }
    }
}

/// The key-set members (`dedup --ledger` on an embedded store) that may stand for the ledger
/// key `key` (see [`KeySpec::ledger_key`]): a member is the first 16 bytes of the record's
/// digest, which is the SHA-256 of `key` for a template, and for key fields the id that `key`
/// spells in hex. A key that reads as both gives both: the second can name another key's
/// member only if that key's SHA-256 is `key`, i.e. one rendered key is the hash of another.
pub fn key_set_members(key: &str) -> Vec<[u8; 16]> {
    let mut members = vec![key_set_member(&id_bytes(key))];
    if let Ok(id) = <[u8; 32]>::try_from(hex::decode(key).unwrap_or_default()) {
        members.push(key_set_member(&id));
    }
    members
}

/// The key-set member of a record whose key has digest `digest`: its first 16 bytes (the bytes
/// of [`short`] too).
pub fn key_set_member(digest: &[u8; 32]) -> [u8; 16] {
    let mut member = [0u8; 16];
    member.copy_from_slice(&digest[..16]);
    member
}

/// A rendered key must be a valid gate key (1..=1024 bytes).
fn check_key(text: &str) -> Result<(), Reject> {
    Key::new(text)
        .map(|_| ())
        .map_err(|e| Reject(format!("rendered key {e}")))
}

/// The first 16 bytes of a digest: the in-memory identity of a key. Two different keys share
/// one only with probability 2^-128 per pair.
pub fn short(digest: &[u8; 32]) -> u128 {
    u128::from_le_bytes(key_set_member(digest))
}

/// A hasher for keys that are already uniformly random (SHA-256 prefixes): it passes the low
/// 64 bits through instead of hashing them again.
#[derive(Default, Clone, Copy)]
pub struct PrehashedHasher(u64);

impl std::hash::Hasher for PrehashedHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u128 keys are hashed; fold any bytes in for completeness.
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.0 ^= u64::from_le_bytes(b);
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

/// Build-hasher of [`PrehashedHasher`].
pub type Prehashed = std::hash::BuildHasherDefault<PrehashedHasher>;
