//! Deterministic ids (API.md "Deterministic ids"): the lowercase hex SHA-256 of the canonical
//! JSON of `{f: record[f] for f in F}` exactly as Python's `json.dumps(obj, sort_keys=True)`
//! writes it, so ids equal those of the common recipe
//! `hashlib.sha256(json.dumps({f: r[f] for f in F}, sort_keys=True).encode()).hexdigest()`.
//!
//! Python's output, rule by rule, as this module reproduces it:
//! - separators `", "` and `": "`; keys sorted at every level by code point (Rust's `str`
//!   order on UTF-8 is the same order); `{}` and `[]` when empty.
//! - `ensure_ascii=True`: `"` `\` and `\b \f \n \r \t` as two-character escapes, every other
//!   character outside `' '..='~'` as `\uXXXX` in lowercase hex, characters beyond the BMP as
//!   a surrogate pair.
//! - a JSON number with a fraction or an exponent is a float, written as Python's `repr`:
//!   the shortest digits that round-trip, in positional form when the decimal exponent is
//!   within `-4 <= e < 16` (with `.0` when integral), otherwise as `1e-07`, `1.5e+300`
//!   (two-digit exponent at least, explicit sign); `-0.0`; overflow to `Infinity`/`-Infinity`.
//! - any other number is an integer of any size, written digit for digit (`-0` is `0`).
//! - `true`, `false`, `null`.
//!
//! A record without one of the key fields has no id: Python would raise `KeyError`; here it
//! is [`IdError::MissingField`] naming the field.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use serde::de::{self, Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Why a record has no id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdError {
    /// The record lacks a key field (Python would raise `KeyError`).
    #[error("missing key field `{field}`")]
    MissingField {
        /// The field.
        field: String,
    },
    /// The record is not a JSON object.
    #[error("the record is {found}, not a JSON object")]
    NotAnObject {
        /// What it is.
        found: &'static str,
    },
    /// The line is not valid JSON.
    #[error("malformed JSON: {reason}")]
    Json {
        /// serde_json's message, with line and column.
        reason: String,
    },
    /// No key fields were given.
    #[error("no key fields given")]
    NoFields,
    /// A key field name is empty (as in `a,,b`).
    #[error("empty key field name in {list:?}")]
    EmptyFieldName {
        /// The list as given.
        list: String,
    },
}

/// The key fields F: sorted by code point and without repeats, as the Python dict ends up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFields {
    names: Vec<String>,
}

impl KeyFields {
    /// Fields from names.
    pub fn new<I, S>(names: I) -> Result<Self, IdError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut names: Vec<String> = names.into_iter().map(Into::into).collect();
        if names.is_empty() {
            return Err(IdError::NoFields);
        }
        if names.iter().any(String::is_empty) {
            return Err(IdError::EmptyFieldName {
                list: names.join(","),
            });
        }
        names.sort();
        names.dedup();
        Ok(Self { names })
    }

    /// Fields from a comma-separated list (`--key-fields a,b`). Names are taken as written:
    /// spaces are part of a name, since JSON keys may hold them.
    pub fn parse(list: &str) -> Result<Self, IdError> {
        if list.is_empty() {
            return Err(IdError::NoFields);
        }
        let names: Vec<&str> = list.split(',').collect();
        if names.iter().any(|n| n.is_empty()) {
            return Err(IdError::EmptyFieldName {
                list: list.to_owned(),
            });
        }
        Self::new(names)
    }

    /// The names in canonical (sorted) order.
    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// A field's value in one of the shapes a face holds it.
#[derive(Debug, Clone, Copy)]
pub enum FieldValue<'a> {
    /// A parsed JSON value.
    Json(&'a Value),
    /// Raw JSON text, as borrowed from a line by [`RawObject`].
    Raw(&'a RawValue),
    /// A string (a CSV cell: Python's `csv.DictReader` gives strings).
    Text(&'a str),
}

/// Writes the canonical JSON of `{f: value(f) for f in fields}` to `out` (cleared first).
pub fn write_canonical_key<'a>(
    fields: &KeyFields,
    mut value: impl FnMut(&str) -> Option<FieldValue<'a>>,
    out: &mut String,
) -> Result<(), IdError> {
    out.clear();
    out.push('{');
    for (i, name) in fields.names.iter().enumerate() {
        let v = value(name).ok_or_else(|| IdError::MissingField {
            field: name.clone(),
        })?;
        if i > 0 {
            out.push_str(", ");
        }
        write_python_str(name, out);
        out.push_str(": ");
        match v {
            FieldValue::Json(v) => write_python_json(v, out),
            FieldValue::Raw(raw) => write_python_json_raw(raw.get(), out)?,
            FieldValue::Text(s) => write_python_str(s, out),
        }
    }
    out.push('}');
    Ok(())
}

/// The canonical JSON of `{f: record[f] for f in fields}` for a parsed record.
pub fn canonical_key(record: &Value, fields: &KeyFields) -> Result<String, IdError> {
    let map = match record {
        Value::Object(map) => map,
        other => return Err(IdError::NotAnObject { found: kind(other) }),
    };
    let mut out = String::new();
    write_canonical_key(fields, |f| map.get(f).map(FieldValue::Json), &mut out)?;
    Ok(out)
}

/// The deterministic id of a parsed record: lowercase hex SHA-256 of [`canonical_key`].
///
/// ```
/// use dedupgate_core::keys::{record_id, KeyFields};
/// let fields = KeyFields::parse("user,amount").unwrap();
/// let record = serde_json::json!({"user": "é", "amount": 0.0000001, "other": 1});
/// // python3 -c 'import json,hashlib; print(hashlib.sha256(json.dumps(
/// //   {"amount": 1e-07, "user": "\u00e9"}, sort_keys=True).encode()).hexdigest())'
/// assert_eq!(
///     dedupgate_core::keys::canonical_key(&record, &fields).unwrap(),
///     r#"{"amount": 1e-07, "user": "\u00e9"}"#
/// );
/// assert_eq!(record_id(&record, &fields).unwrap().len(), 64);
/// ```
pub fn record_id(record: &Value, fields: &KeyFields) -> Result<String, IdError> {
    Ok(id_hex(&canonical_key(record, fields)?))
}

/// Lowercase hex SHA-256 of a canonical key.
pub fn id_hex(canonical: &str) -> String {
    hex::encode(id_bytes(canonical))
}

/// SHA-256 of a canonical key.
pub fn id_bytes(canonical: &str) -> [u8; 32] {
    Sha256::digest(canonical.as_bytes()).into()
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Writes `v` as Python's `json.dumps(v, sort_keys=True)` does.
pub fn write_python_json(v: &Value, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => write_python_number(n.as_str(), out),
        Value::String(s) => write_python_str(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_json(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            // Sorted explicitly: the map is ordered by key only while serde_json's
            // `preserve_order` feature is off somewhere in the build.
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_python_str(k, out);
                out.push_str(": ");
                write_python_json(v, out);
            }
            out.push('}');
        }
    }
}

/// Writes raw JSON text as Python would re-write it after `json.loads`. The shapes keys are
/// made of (plain ASCII strings, integers, literals) are copied without parsing.
pub fn write_python_json_raw(raw: &str, out: &mut String) -> Result<(), IdError> {
    let raw = raw.trim_matches(|c| matches!(c, ' ' | '\t' | '\n' | '\r'));
    let bytes = raw.as_bytes();
    match bytes.first() {
        Some(b'"')
            if bytes.len() >= 2
                && bytes[1..bytes.len() - 1]
                    .iter()
                    .all(|&b| (b' '..=b'~').contains(&b) && b != b'\\') =>
        {
            out.push_str(raw);
            Ok(())
        }
        Some(b'-' | b'0'..=b'9') => {
            write_python_number(raw, out);
            Ok(())
        }
        Some(b't' | b'f' | b'n') if matches!(raw, "true" | "false" | "null") => {
            out.push_str(raw);
            Ok(())
        }
        _ => {
            let v: Value = serde_json::from_str(raw).map_err(|e| IdError::Json {
                reason: e.to_string(),
            })?;
            write_python_json(&v, out);
            Ok(())
        }
    }
}

/// Writes a JSON number (its text as in the input) as Python writes the value `json.loads`
/// makes of it: a float when the text has a fraction or an exponent, else an integer.
pub fn write_python_number(text: &str, out: &mut String) {
    if text.contains(['.', 'e', 'E']) {
        // Rust's parse rounds correctly and overflows to ±inf exactly as Python's float() does.
        match text.parse::<f64>() {
            Ok(f) => write_python_float(f, out),
            // Unreachable for text serde_json accepted as a number; keep the text rather
            // than panic.
            Err(_) => out.push_str(text),
        }
    } else if text.bytes().all(|b| b == b'-' || b == b'0') && text.contains('0') {
        out.push('0'); // `-0` is the integer 0 in Python
    } else {
        out.push_str(text);
    }
}

/// Writes a float as Python's `repr` (and therefore `json.dumps`) writes it.
///
/// ```
/// let repr = |f: f64| { let mut s = String::new(); dedupgate_core::keys::write_python_float(f, &mut s); s };
/// assert_eq!(repr(1e-7), "1e-07");
/// assert_eq!(repr(1e16), "1e+16");
/// assert_eq!(repr(1e15), "1000000000000000.0");
/// assert_eq!(repr(-0.0), "-0.0");
/// assert_eq!(repr(0.1), "0.1");
/// assert_eq!(repr(1.5e300), "1.5e+300");
/// assert_eq!(repr(f64::INFINITY), "Infinity");
/// assert_eq!(repr(949564438381394.25), "949564438381394.2"); // a tie: the even digit
/// ```
pub fn write_python_float(f: f64, out: &mut String) {
    if f.is_nan() {
        out.push_str("NaN");
        return;
    }
    if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    // Python's repr takes the shortest digits that round-trip and, when two such strings are
    // equally close to the binary value, the one ending in an even digit (949564438381394.25 is
    // written ...394.2). Ryu breaks ties the same way; Rust's own `{:e}` rounds them up.
    let mut buffer = ryu::Buffer::new();
    let text = buffer.format_finite(f);
    let (sign, text) = match text.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", text),
    };
    let (mantissa, exp) = text.split_once(['e', 'E']).unwrap_or((text, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (int_part, frac_part) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    // The value is 0.DIGITS x 10^decpt.
    let all = format!("{int_part}{frac_part}");
    let leading = all.len() - all.trim_start_matches('0').len();
    let digits = all.trim_start_matches('0').trim_end_matches('0');
    let (digits, decpt) = if digits.is_empty() {
        ("0".to_owned(), 1)
    } else {
        (
            digits.to_owned(),
            int_part.len() as i32 + exp - leading as i32,
        )
    };
    // Python's rule (format_float_short, mode 'r'): with the value as 0.DIGITS x 10^decpt,
    // positional when -4 < decpt <= 16, else exponent notation.
    let exp = decpt - 1;
    out.push_str(sign);
    if decpt <= -4 || decpt > 16 {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        let abs = exp.unsigned_abs();
        if abs < 10 {
            out.push('0');
        }
        out.push_str(&abs.to_string());
    } else if decpt <= 0 {
        out.push_str("0.");
        for _ in 0..(-decpt) {
            out.push('0');
        }
        out.push_str(&digits);
    } else {
        let point = decpt as usize;
        if point >= digits.len() {
            out.push_str(&digits);
            for _ in digits.len()..point {
                out.push('0');
            }
            out.push_str(".0");
        } else {
            out.push_str(&digits[..point]);
            out.push('.');
            out.push_str(&digits[point..]);
        }
    }
}

/// Writes a string as Python's `json.dumps` does with `ensure_ascii=True`.
pub fn write_python_str(s: &str, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push('"');
    let mut plain_from = 0;
    for (i, c) in s.char_indices() {
        if (' '..='~').contains(&c) && c != '"' && c != '\\' {
            continue;
        }
        out.push_str(&s[plain_from..i]);
        plain_from = i + c.len_utf8();
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            _ => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str("\\u");
                    for shift in [12, 8, 4, 0] {
                        out.push(HEX[usize::from((*unit >> shift) & 0xf)] as char);
                    }
                }
            }
        }
    }
    out.push_str(&s[plain_from..]);
    out.push('"');
}

/// The top-level fields of one JSON object line, borrowed from it: keys (unescaped) and raw
/// values with their byte spans, so a face can compute a key from a few fields without
/// building the whole record, and can add a field while leaving the rest of the line as it was.
#[derive(Debug)]
pub struct RawObject<'a> {
    line: &'a str,
    entries: Vec<(Cow<'a, str>, &'a RawValue)>,
}

struct Entries<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

struct KeyText<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for KeyText<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeyText<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(KeyText(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(KeyText(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(KeyText(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> Deserialize<'de> for Entries<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(8).min(64));
                while let Some(KeyText(k)) = map.next_key()? {
                    let v: &'de RawValue = map.next_value()?;
                    entries.push((k, v));
                }
                Ok(Entries(entries))
            }
        }
        d.deserialize_map(V)
    }
}

impl<'a> RawObject<'a> {
    /// Parses one line holding a JSON object.
    pub fn parse(line: &'a str) -> Result<Self, IdError> {
        let first = line
            .bytes()
            .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'));
        if first != Some(b'{') {
            if first.is_none() {
                return Err(IdError::NotAnObject { found: "empty" });
            }
            // Valid JSON of another kind, or not JSON at all: say which.
            return Err(match serde_json::from_str::<Value>(line) {
                Ok(v) => IdError::NotAnObject { found: kind(&v) },
                Err(e) => IdError::Json {
                    reason: e.to_string(),
                },
            });
        }
        let Entries(entries) = serde_json::from_str(line).map_err(|e| IdError::Json {
            reason: e.to_string(),
        })?;
        Ok(Self { line, entries })
    }

    /// The line parsed.
    pub fn line(&self) -> &'a str {
        self.line
    }

    /// The raw value of a top-level field; the last one when a key repeats, as `json.loads`.
    pub fn get(&self, name: &str) -> Option<&'a RawValue> {
        self.entries
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| *v)
    }

    /// How many times a top-level key occurs.
    pub fn count(&self, name: &str) -> usize {
        self.entries.iter().filter(|(k, _)| k == name).count()
    }

    /// Byte range of a top-level field's value within the line (the last occurrence).
    pub fn value_span(&self, name: &str) -> Option<Range<usize>> {
        let raw = self.get(name)?.get();
        let start = raw.as_ptr() as usize - self.line.as_ptr() as usize;
        Some(start..start + raw.len())
    }

    /// The number of top-level entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True for `{}`.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Writes the canonical key of this object for `fields` into `out` (cleared first).
    pub fn write_canonical_key(&self, fields: &KeyFields, out: &mut String) -> Result<(), IdError> {
        write_canonical_key(fields, |f| self.get(f).map(FieldValue::Raw), out)
    }

    /// The line with a top-level string field `name` set to `value`: an existing value is
    /// replaced in place (every occurrence of a repeated key is left but the last), otherwise
    /// the field is appended before the closing brace. Everything else stays byte for byte.
    pub fn with_string_field(&self, name: &str, value: &str) -> String {
        let mut quoted = String::with_capacity(value.len() + 2);
        write_python_str(value, &mut quoted);
        let line = self.line.trim_end_matches(['\n', '\r']);
        if let Some(span) = self.value_span(name) {
            let mut out = String::with_capacity(line.len() + quoted.len());
            out.push_str(&line[..span.start]);
            out.push_str(&quoted);
            out.push_str(&line[span.end..]);
            return out;
        }
        // The object's closing brace is the last non-space byte of the line.
        let close = line.trim_end().len() - 1;
        let mut out = String::with_capacity(line.len() + name.len() + quoted.len() + 8);
        out.push_str(&line[..close]);
        if !self.is_empty() {
            out.push(',');
        }
        write_python_str(name, &mut out);
        out.push(':');
        out.push_str(&quoted);
        out.push_str(&line[close..]);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn repr(f: f64) -> String {
        let mut s = String::new();
        write_python_float(f, &mut s);
        s
    }

    #[test]
    fn floats_as_python_repr() {
        for (f, want) in [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e-7, "1e-07"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (1.5e300, "1.5e+300"),
            (5e-324, "5e-324"),
            (2.2250738585072014e-308, "2.2250738585072014e-308"),
            (f64::MAX, "1.7976931348623157e+308"),
            (-1.25, "-1.25"),
            (100.0, "100.0"),
            (9007199254740993.0, "9007199254740992.0"),
        ] {
            assert_eq!(repr(f), want, "{f:?}");
        }
    }

    #[test]
    fn numbers_keep_their_kind() {
        let n = |t: &str| {
            let mut s = String::new();
            write_python_number(t, &mut s);
            s
        };
        assert_eq!(n("-0"), "0");
        assert_eq!(n("0"), "0");
        assert_eq!(n("-0.0"), "-0.0");
        assert_eq!(n("1E5"), "100000.0");
        assert_eq!(n("1e400"), "Infinity");
        assert_eq!(n("-1e400"), "-Infinity");
        assert_eq!(n("1e-400"), "0.0");
        assert_eq!(
            n("123456789012345678901234567890"),
            "123456789012345678901234567890"
        );
        assert_eq!(n("1.50"), "1.5");
    }

    #[test]
    fn strings_ensure_ascii() {
        let s = |t: &str| {
            let mut o = String::new();
            write_python_str(t, &mut o);
            o
        };
        assert_eq!(s("a\"b\\c\n\r\t\u{8}\u{c}"), r#""a\"b\\c\n\r\t\b\f""#);
        assert_eq!(s("\u{0}\u{1f}\u{7f}é"), r#""\u0000\u001f\u007f\u00e9""#);
        assert_eq!(s("😀"), r#""\ud83d\ude00""#);
        assert_eq!(s("/"), r#""/""#);
    }

    #[test]
    fn canonical_keys_sort_and_nest() {
        let fields = KeyFields::parse("b,a,b").unwrap();
        assert_eq!(fields.names(), ["a", "b"]);
        let rec = json!({"b": {"z": [1, 2.5, null, true], "é": {}, "A": []}, "a": "x", "c": 1});
        assert_eq!(
            canonical_key(&rec, &fields).unwrap(),
            r#"{"a": "x", "b": {"A": [], "z": [1, 2.5, null, true], "\u00e9": {}}}"#
        );
        assert_eq!(
            canonical_key(&json!({"a": 1}), &fields),
            Err(IdError::MissingField { field: "b".into() })
        );
        assert!(matches!(
            canonical_key(&json!([1]), &fields),
            Err(IdError::NotAnObject { .. })
        ));
        assert!(matches!(KeyFields::parse(""), Err(IdError::NoFields)));
        assert!(matches!(
            KeyFields::parse("a,,b"),
            Err(IdError::EmptyFieldName { .. })
        ));
    }

    #[test]
    fn raw_and_parsed_paths_agree() {
        let fields = KeyFields::parse("a,b,c,d").unwrap();
        let line = r#"{"a": "plain", "b": "\u00e9\/x", "c": -0, "d": [1.0, {"y": 1, "x": "😀"}], "a": "last"}"#;
        let raw = RawObject::parse(line).unwrap();
        let mut via_raw = String::new();
        raw.write_canonical_key(&fields, &mut via_raw).unwrap();
        let parsed: Value = serde_json::from_str(line).unwrap();
        assert_eq!(via_raw, canonical_key(&parsed, &fields).unwrap());
        assert_eq!(
            via_raw,
            r#"{"a": "last", "b": "\u00e9/x", "c": 0, "d": [1.0, {"x": "\ud83d\ude00", "y": 1}]}"#
        );
    }

    #[test]
    fn raw_object_errors_and_splicing() {
        assert!(matches!(
            RawObject::parse("[1]"),
            Err(IdError::NotAnObject { found: "an array" })
        ));
        assert!(matches!(
            RawObject::parse("   "),
            Err(IdError::NotAnObject { found: "empty" })
        ));
        assert!(matches!(
            RawObject::parse("{\"a\": }"),
            Err(IdError::Json { .. })
        ));
        assert!(matches!(
            RawObject::parse("{\"a\": 1} x"),
            Err(IdError::Json { .. })
        ));
        assert!(matches!(
            RawObject::parse("nope"),
            Err(IdError::Json { .. })
        ));
        let o = RawObject::parse(r#"{"a": 1, "id": "old" }"#).unwrap();
        assert_eq!(
            o.with_string_field("id", "new"),
            r#"{"a": 1, "id": "new" }"#
        );
        let o = RawObject::parse("{\"a\":1}\n").unwrap();
        assert_eq!(o.with_string_field("id", "x"), r#"{"a":1,"id":"x"}"#);
        let o = RawObject::parse(" { } ").unwrap();
        assert_eq!(o.with_string_field("id", "x"), r#" { "id":"x"} "#);
    }
}
