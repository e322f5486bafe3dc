//! Translation between API.md's JSON and the core's [`Op`] and [`Outcome`]; nothing is decided here.
//!
//! Policy for request bodies: unknown fields are ignored (so newer clients can talk to older
//! servers); a known field of the wrong type, malformed JSON, a missing required field or an
//! out-of-range value is 400 `invalid_request`; a `result` larger than the configured limit is
//! 413 `payload_too_large`. Every check happens before the store is called, so a refused request
//! never changes anything.

use dedupgate_core::{
    Claim, ClaimOptions, CompleteOptions, Defaults, Lease, MarkOptions, Op, Outcome, RecordId,
    Request, Token, ValidOp,
};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::config::Limits;
use crate::problem::Problem;

/// The operations of API.md, as routes and as batch `op` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// `POST /v1/claim`, `"op":"claim"`.
    Claim,
    /// `POST /v1/complete`.
    Complete,
    /// `POST /v1/release`.
    Release,
    /// `POST /v1/extend`.
    Extend,
    /// `POST /v1/mark`.
    Mark,
    /// `GET /v1/record`.
    Get,
    /// `DELETE /v1/record` (admin).
    Forget,
}

impl OpKind {
    /// The batch `op` name and metrics label.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Claim => "claim",
            OpKind::Complete => "complete",
            OpKind::Release => "release",
            OpKind::Extend => "extend",
            OpKind::Mark => "mark",
            OpKind::Get => "get",
            OpKind::Forget => "forget",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "claim" => OpKind::Claim,
            "complete" => OpKind::Complete,
            "release" => OpKind::Release,
            "extend" => OpKind::Extend,
            "mark" => OpKind::Mark,
            "get" => OpKind::Get,
            "forget" => OpKind::Forget,
            _ => return None,
        })
    }

    /// True for operations only an admin token may run.
    pub fn admin(self) -> bool {
        self == OpKind::Forget
    }
}

// Durations are kept as raw JSON and read by [`duration`], which takes integral floats and
// words its own errors; `null` reaches it as `None`, the same as an absent field.
#[derive(Deserialize)]
struct ClaimReq<'a> {
    namespace: String,
    key: String,
    #[serde(borrow)]
    ttl_ms: Option<&'a RawValue>,
    #[serde(borrow)]
    lease_ms: Option<&'a RawValue>,
    fingerprint: Option<String>,
    owner: Option<String>,
}

#[derive(Deserialize)]
struct CompleteReq<'a> {
    namespace: String,
    key: String,
    token: String,
    result: Option<Value>,
    #[serde(borrow)]
    ttl_ms: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ReleaseReq {
    namespace: String,
    key: String,
    token: String,
}

#[derive(Deserialize)]
struct ExtendReq<'a> {
    namespace: String,
    key: String,
    token: String,
    #[serde(borrow)]
    lease_ms: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct MarkReq<'a> {
    namespace: String,
    key: String,
    #[serde(borrow)]
    ttl_ms: Option<&'a RawValue>,
    fingerprint: Option<String>,
    result: Option<Value>,
}

/// The identity fields of `GET`/`DELETE /v1/record` (query string) and of batch get/forget.
#[derive(Debug, Deserialize)]
pub struct RecordReq {
    /// The namespace.
    pub namespace: String,
    /// The key.
    pub key: String,
}

/// The `namespace` and `key` of a `GET`/`DELETE /v1/record` query string, form-decoded (`%XX`
/// escapes, `+` for a space; other parameters are ignored). Decoded bytes that are not UTF-8
/// are refused, not replaced with U+FFFD: a lossy decoding would name another record. A
/// parameter given twice is refused too, since either value could be meant.
pub fn record_query(query: Option<&str>) -> Result<RecordReq, Problem> {
    let mut namespace = None;
    let mut key = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = form_decode(name)
            .map_err(|_| Problem::invalid("a query parameter name is not UTF-8 once decoded"))?;
        let slot = match name.as_str() {
            "namespace" => &mut namespace,
            "key" => &mut key,
            _ => continue,
        };
        if slot.is_some() {
            return Err(Problem::invalid(format!(
                "query parameter `{name}` is given more than once"
            )));
        }
        *slot = Some(form_decode(value).map_err(|e| {
            Problem::invalid(format!(
                "query parameter `{name}` is not UTF-8 once percent-decoded (invalid byte at \
                 {}): percent-encode the UTF-8 bytes of the text",
                e.utf8_error().valid_up_to()
            ))
        })?);
    }
    match (namespace, key) {
        (Some(namespace), Some(key)) => Ok(RecordReq { namespace, key }),
        (None, _) => Err(Problem::invalid(
            "query must carry namespace and key: `namespace` is missing",
        )),
        (_, None) => Err(Problem::invalid(
            "query must carry namespace and key: `key` is missing",
        )),
    }
}

/// `application/x-www-form-urlencoded` decoding of one name or value, strict about UTF-8. A `%`
/// not followed by two hex digits stays as it is (as in the URL standard).
fn form_decode(text: &str) -> Result<String, std::string::FromUtf8Error> {
    fn hex(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            b'A'..=b'F' => Some(b - b'A' + 10),
            _ => None,
        }
    }
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let pair = bytes
                    .get(i + 1)
                    .and_then(|&h| hex(h))
                    .zip(bytes.get(i + 2).and_then(|&l| hex(l)));
                if let Some((h, l)) = pair {
                    out.push(h << 4 | l);
                    i += 3;
                    continue;
                }
                out.push(b'%');
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out)
}

/// A parsed, validated request: ready for the store.
#[derive(Debug)]
pub struct Parsed {
    /// Which operation.
    pub kind: OpKind,
    /// The record it acts on.
    pub id: RecordId,
    /// The operation, defaults applied and checked by the core.
    pub op: ValidOp,
}

fn json_problem(e: serde_json::Error) -> Problem {
    Problem::invalid(format!("malformed request: {}", json_words(&e)))
}

/// serde_json's message for `e` in JSON's words: serde calls an object a map and an array a
/// sequence.
fn json_words(e: &serde_json::Error) -> String {
    e.to_string()
        .replace("invalid type: map,", "invalid type: object,")
        .replace("invalid type: sequence,", "invalid type: array,")
        .replace("expected a sequence", "expected an array")
        .replace("expected a map", "expected an object")
}

/// Refuses a body whose JSON value is not an object. serde reads a struct from an array too
/// (`["ns","k",60000]` would be a claim), and its error for other values names the Rust type.
/// Malformed text is left to serde_json, which says where it breaks.
fn must_be_object(body: &[u8], shape: &str) -> Result<(), Problem> {
    let first = body
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'));
    let got = match first {
        None => "an empty body",
        Some(b'{') => return Ok(()),
        Some(b'[') => "an array",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        Some(b'-' | b'0'..=b'9') => "a number",
        Some(_) => return Ok(()),
    };
    Err(Problem::invalid(format!(
        "the body must be a JSON object ({shape}), got {got}"
    )))
}

/// Parses the body of a single-op route.
pub fn parse_body(
    kind: OpKind,
    body: &[u8],
    defaults: &Defaults,
    limits: &Limits,
) -> Result<Parsed, Problem> {
    must_be_object(body, "{\"namespace\":…,\"key\":…}")?;
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed = parse_from(kind, &mut de, defaults, limits)?;
    de.end().map_err(json_problem)?;
    Ok(parsed)
}

/// One item of a batch as it arrives: the fields any op may take, each still raw JSON text,
/// or why the item is refused before its fields are looked at. Read in the same pass as the
/// `ops` array, so a batch is parsed once; a field is typed only when the item's op uses it
/// (a field the op does not take is ignored, as in a single-op body).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BatchItem<'a> {
    op: Option<&'a str>,
    namespace: Option<&'a str>,
    key: Option<&'a str>,
    token: Option<&'a str>,
    ttl_ms: Option<&'a str>,
    lease_ms: Option<&'a str>,
    fingerprint: Option<&'a str>,
    owner: Option<&'a str>,
    result: Option<&'a str>,
    refused: Option<&'static str>,
}

const DUPLICATE_FIELD: &str = "a batch op names one of its fields twice";

impl<'a> BatchItem<'a> {
    /// The slot of a known field name (unescaped), `None` for a field no op takes.
    fn slot(&mut self, name: &str) -> Option<&mut Option<&'a str>> {
        Some(match name {
            "op" => &mut self.op,
            "namespace" => &mut self.namespace,
            "key" => &mut self.key,
            "token" => &mut self.token,
            "ttl_ms" => &mut self.ttl_ms,
            "lease_ms" => &mut self.lease_ms,
            "fingerprint" => &mut self.fingerprint,
            "owner" => &mut self.owner,
            "result" => &mut self.result,
            _ => return None,
        })
    }

    /// Keeps a field's raw text; a known field given twice refuses the item.
    fn set(&mut self, name: &str, raw: &'a str) {
        if let Some(slot) = self.slot(name) {
            if slot.replace(raw).is_some() {
                self.refused.get_or_insert(DUPLICATE_FIELD);
            }
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for BatchItem<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        de.deserialize_any(ItemVisitor)
    }
}

struct ItemVisitor;

/// A field name of a batch item, read without allocating: the known name, or `None`.
struct Field(Option<&'static str>);

const ITEM_FIELDS: [&str; 9] = [
    "op",
    "namespace",
    "key",
    "token",
    "ttl_ms",
    "lease_ms",
    "fingerprint",
    "owner",
    "result",
];

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: serde::Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Field;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E>(self, name: &str) -> Result<Field, E> {
                Ok(Field(ITEM_FIELDS.iter().copied().find(|f| *f == name)))
            }
        }
        de.deserialize_identifier(V)
    }
}

const NOT_AN_OBJECT: &str = "a batch op must be a JSON object with an `op` field";

impl<'de> serde::de::Visitor<'de> for ItemVisitor {
    type Value = BatchItem<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a batch op")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut item = BatchItem::default();
        while let Some(Field(field)) = map.next_key::<Field>()? {
            match field {
                Some(name) => {
                    let value = map.next_value::<&'de RawValue>()?;
                    item.set(name, value.get());
                }
                None => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(item)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
        Ok(BatchItem::refused())
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(BatchItem::refused())
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(BatchItem::refused())
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(BatchItem::refused())
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(BatchItem::refused())
    }

    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(BatchItem::refused())
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(BatchItem::refused())
    }
}

impl BatchItem<'_> {
    fn refused() -> Self {
        Self {
            refused: Some(NOT_AN_OBJECT),
            ..Self::default()
        }
    }
}

/// A field the op takes, typed from its raw text; `null` counts as absent.
fn opt_field<'a, T: Deserialize<'a>>(
    raw: Option<&'a str>,
    name: &str,
) -> Result<Option<T>, Problem> {
    match raw {
        None => Ok(None),
        Some(raw) => serde_json::from_str::<Option<T>>(raw).map_err(|e| {
            Problem::invalid(format!("malformed request: {name}: {}", json_words(&e)))
        }),
    }
}

/// A duration the op needs: absent and `null` alike are refused.
fn required_duration(raw: Option<&str>, name: &str) -> Result<u64, Problem> {
    duration(raw, name)?.ok_or_else(|| {
        Problem::invalid(format!(
            "malformed request: missing field `{name}` (a whole number of milliseconds)"
        ))
    })
}

/// A duration field's raw JSON text (absent or `null`: `None`). A number with no fractional
/// part is its value whatever its spelling (`60000`, `60000.0`, `6e4`: JavaScript and Python
/// clients send floats); fractions, negatives, numbers past `u64` and other types are refused,
/// naming the field. Zero and values past the maximum are left to [`Op::validate`].
fn duration(raw: Option<&str>, name: &str) -> Result<Option<u64>, Problem> {
    let text = match raw.map(str::trim) {
        None | Some("null") => return Ok(None),
        Some(text) => text,
    };
    // The usual case, without the general reader: plain digits, no leading zero.
    if text.bytes().all(|b| b.is_ascii_digit()) && (text.len() == 1 || !text.starts_with('0')) {
        if let Ok(n) = text.parse() {
            return Ok(Some(n));
        }
    }
    let shown = shorten(text);
    let why = match whole_number(text) {
        Some(Whole::Value(n)) => return Ok(Some(n)),
        Some(Whole::Negative) => format!("must be a positive number of milliseconds, got {shown}"),
        Some(Whole::Fraction) => format!("must be a whole number of milliseconds, got {shown}"),
        Some(Whole::TooLarge) => format!(
            "must be at most {} ms, got {shown}",
            dedupgate_core::op::DURATION_MS_MAX
        ),
        None => format!(
            "must be a whole number of milliseconds, got {}",
            json_kind(text)
        ),
    };
    Err(Problem::invalid(format!("{name}: {why}")))
}

/// What a number's exact decimal text stands for, as a duration.
#[derive(Debug, PartialEq, Eq)]
enum Whole {
    Value(u64),
    Negative,
    Fraction,
    TooLarge,
}

/// Reads JSON number text exactly (no float rounding: `9007199254740993.0` is that integer,
/// `1.0000000000000001` a fraction); `None` when `text` is not a JSON number.
fn whole_number(text: &str) -> Option<Whole> {
    let digits_only = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    let (negative, rest) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(i) => (&rest[..i], Some(&rest[i + 1..])),
        None => (rest, None),
    };
    let (int, frac) = match mantissa.split_once('.') {
        Some((int, frac)) if !frac.is_empty() => (int, frac),
        Some(_) => return None,
        None => (mantissa, ""),
    };
    if int.is_empty() || !digits_only(int) || !digits_only(frac) {
        return None;
    }
    let exponent: i64 = match exponent {
        None => 0,
        Some(e) => {
            let (sign, e) = match e.as_bytes().first() {
                Some(b'-') => (-1, &e[1..]),
                Some(b'+') => (1, &e[1..]),
                _ => (1, e),
            };
            if e.is_empty() || !digits_only(e) {
                return None;
            }
            // Saturates: an exponent past i64 only matters by its sign.
            match e.trim_start_matches('0') {
                "" => 0,
                magnitude => sign * magnitude.parse::<i64>().unwrap_or(i64::MAX),
            }
        }
    };
    let digits = int.as_bytes().iter().chain(frac.as_bytes());
    let mut significant: Vec<u8> = digits.copied().skip_while(|&d| d == b'0').collect();
    if significant.is_empty() {
        return Some(Whole::Value(0));
    }
    if negative {
        return Some(Whole::Negative);
    }
    let mut scale = exponent.saturating_sub(frac.len() as i64);
    while significant.last() == Some(&b'0') {
        significant.pop();
        scale = scale.saturating_add(1);
    }
    if scale < 0 {
        return Some(Whole::Fraction);
    }
    if scale.saturating_add(significant.len() as i64) > 20 {
        return Some(Whole::TooLarge);
    }
    let mut n: u64 = 0;
    for d in significant {
        n = match n
            .checked_mul(10)
            .and_then(|n| n.checked_add(u64::from(d - b'0')))
        {
            Some(n) => n,
            None => return Some(Whole::TooLarge),
        };
    }
    for _ in 0..scale {
        n = match n.checked_mul(10) {
            Some(n) => n,
            None => return Some(Whole::TooLarge),
        };
    }
    Some(Whole::Value(n))
}

/// The JSON type of a value's raw text, for messages.
fn json_kind(raw: &str) -> &'static str {
    match raw.as_bytes().first() {
        Some(b'"') => "a string",
        Some(b'{') => "an object",
        Some(b'[') => "an array",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        _ => "a value of another type",
    }
}

/// A value's text cut for a message (a number may be thousands of digits long).
fn shorten(text: &str) -> String {
    const SHOWN: usize = 40;
    match text.char_indices().nth(SHOWN) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

/// The text of a JSON string that holds no escape, straight from its raw form (quotes off):
/// the usual case, without a deserializer. The raw value was validated when it was read.
fn plain_str(raw: &str) -> Option<&str> {
    raw.strip_prefix('"')?
        .strip_suffix('"')
        .filter(|s| !s.contains('\\'))
}

/// A string field the op needs.
fn req_string(raw: Option<&str>, name: &str) -> Result<String, Problem> {
    match raw.and_then(plain_str) {
        Some(s) => Ok(s.to_owned()),
        None => req_field(raw, name),
    }
}

/// A field the op needs.
fn req_field<'a, T: Deserialize<'a>>(raw: Option<&'a str>, name: &str) -> Result<T, Problem> {
    match raw {
        None => Err(Problem::invalid(format!(
            "malformed request: missing field `{name}`"
        ))),
        Some(raw) => serde_json::from_str::<T>(raw).map_err(|e| {
            Problem::invalid(format!("malformed request: {name}: {}", json_words(&e)))
        }),
    }
}

/// Parses one item of a batch read as [`BatchItem`].
pub fn parse_batch_item(
    item: &BatchItem<'_>,
    defaults: &Defaults,
    limits: &Limits,
) -> Result<Parsed, Problem> {
    if let Some(why) = item.refused {
        return Err(Problem::invalid(why));
    }
    let kind = match item.op.and_then(plain_str).and_then(OpKind::from_name) {
        Some(kind) => Ok(kind),
        None => Err(item.op.map(serde_json::from_str::<Value>)),
    };
    let kind = match kind {
        Ok(kind) => kind,
        Err(Some(Ok(Value::String(name)))) => OpKind::from_name(&name).ok_or_else(|| {
            Problem::invalid(format!(
                "unknown op {name:?}: use claim, complete, release, extend, mark, get or forget"
            ))
        })?,
        Err(Some(_)) => return Err(Problem::invalid("op must be a string")),
        Err(None) => return Err(Problem::invalid("missing field `op`")),
    };
    let token = || req_string(item.token, "token").map(Token::new);
    let request = match kind {
        OpKind::Claim => Request::Claim(ClaimOptions {
            ttl_ms: duration(item.ttl_ms, "ttl_ms")?,
            lease_ms: duration(item.lease_ms, "lease_ms")?,
            fingerprint: opt_field(item.fingerprint, "fingerprint")?,
            owner: opt_field(item.owner, "owner")?,
        }),
        OpKind::Complete => Request::Complete {
            token: token()?,
            opts: CompleteOptions {
                result: opt_field(item.result, "result")?,
                ttl_ms: duration(item.ttl_ms, "ttl_ms")?,
            },
        },
        OpKind::Release => Request::Release { token: token()? },
        OpKind::Extend => Request::Extend {
            token: token()?,
            lease_ms: required_duration(item.lease_ms, "lease_ms")?,
        },
        OpKind::Mark => Request::Mark(MarkOptions {
            ttl_ms: duration(item.ttl_ms, "ttl_ms")?,
            fingerprint: opt_field(item.fingerprint, "fingerprint")?,
            result: opt_field(item.result, "result")?,
        }),
        OpKind::Get => Request::Get,
        OpKind::Forget => Request::Forget,
    };
    let namespace = req_string(item.namespace, "namespace")?;
    let key = req_string(item.key, "key")?;
    let id = record_id(namespace, key, limits)?;
    let op = valid_op(request, defaults, limits)?;
    Ok(Parsed { kind, id, op })
}

/// Parses one item of a batch given as its raw JSON text: `{"op": NAME, …fields of NAME}`.
pub fn parse_item(
    item: &RawValue,
    defaults: &Defaults,
    limits: &Limits,
) -> Result<Parsed, Problem> {
    let fields: BatchItem<'_> =
        serde_json::from_str(item.get()).map_err(|_| Problem::invalid(NOT_AN_OBJECT))?;
    parse_batch_item(&fields, defaults, limits)
}

/// Reads a batch body, `{"ops":[…]}`, into its items. Bodies in the common shape (objects of
/// plain strings, unsigned integers and nulls, no escapes) are read by [`scan_batch`] without
/// a deserializer; anything else, and any body it does not accept, is read by serde_json,
/// which also words the error of a malformed body. Both give the same items (tested).
pub fn parse_batch(body: &[u8]) -> Result<Vec<BatchItem<'_>>, Problem> {
    if let Some(items) = std::str::from_utf8(body).ok().and_then(scan_batch) {
        return Ok(items);
    }
    #[derive(Deserialize)]
    struct BatchReq<'a> {
        #[serde(borrow)]
        ops: Vec<BatchItem<'a>>,
    }
    must_be_object(body, "{\"ops\":[…]}")?;
    serde_json::from_slice::<BatchReq<'_>>(body)
        .map(|r| r.ops)
        .map_err(|e| {
            Problem::invalid(format!(
                "the body must be {{\"ops\":[…]}}: {}",
                json_words(&e)
            ))
        })
}

/// The common shape of a batch body, read by hand: `{"ops":[` objects `]}` whose field names
/// are plain strings and whose values are plain strings, unsigned integers or `null`
/// (JSON whitespace allowed between tokens). `None` for anything else (escapes, nested values,
/// other numbers, booleans, other top-level fields, malformed text): serde_json reads it then.
fn scan_batch(text: &str) -> Option<Vec<BatchItem<'_>>> {
    let mut scan = Scan { text, at: 0 };
    scan.eat(b'{')?;
    if scan.string()? != "ops" {
        return None;
    }
    scan.eat(b':')?;
    scan.eat(b'[')?;
    // At least ~40 bytes per claim item, and no more than a batch may hold (the count is
    // checked after the parse; a body past it must not reserve memory for all its items).
    let mut items =
        Vec::with_capacity((text.len() / 40 + 1).min(dedupgate_core::BATCH_OPS_MAX + 1));
    scan.ws();
    if scan.peek()? == b']' {
        scan.at += 1;
    } else {
        loop {
            items.push(scan.item()?);
            scan.ws();
            match scan.peek()? {
                b',' => scan.at += 1,
                b']' => {
                    scan.at += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    scan.eat(b'}')?;
    scan.ws();
    (scan.at == text.len()).then_some(items)
}

struct Scan<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Scan<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.at).copied()
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.at += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        self.ws();
        (self.peek()? == byte).then(|| self.at += 1)
    }

    /// A string without escapes or control characters; its text without the quotes.
    fn string(&mut self) -> Option<&'a str> {
        self.ws();
        if self.peek()? != b'"' {
            return None;
        }
        let start = self.at + 1;
        let bytes = self.text.as_bytes().get(start..)?;
        let len = bytes
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
        if bytes[len] != b'"' {
            return None;
        }
        self.at = start + len + 1;
        self.text.get(start..start + len)
    }

    /// A plain string (quotes kept), an unsigned integer or `null`: its raw text.
    fn value(&mut self) -> Option<&'a str> {
        self.ws();
        let start = self.at;
        match self.peek()? {
            b'"' => {
                self.string()?;
            }
            b'0'..=b'9' => {
                let digits = self.text.as_bytes()[start..]
                    .iter()
                    .take_while(|b| b.is_ascii_digit())
                    .count();
                // JSON has no leading zeros; a fraction or exponent stops the caller.
                if digits > 1 && self.text.as_bytes()[start] == b'0' {
                    return None;
                }
                self.at += digits;
            }
            b'n' if self.text[start..].starts_with("null") => self.at += 4,
            _ => return None,
        }
        self.text.get(start..self.at)
    }

    fn item(&mut self) -> Option<BatchItem<'a>> {
        self.eat(b'{')?;
        let mut item = BatchItem::default();
        self.ws();
        if self.peek()? == b'}' {
            self.at += 1;
            return Some(item);
        }
        loop {
            let name = self.string()?;
            self.eat(b':')?;
            let value = self.value()?;
            item.set(name, value);
            self.ws();
            match self.peek()? {
                b',' => self.at += 1,
                b'}' => {
                    self.at += 1;
                    return Some(item);
                }
                _ => return None,
            }
        }
    }
}

fn parse_from<'de, D>(
    kind: OpKind,
    de: D,
    defaults: &Defaults,
    limits: &Limits,
) -> Result<Parsed, Problem>
where
    D: serde::Deserializer<'de, Error = serde_json::Error>,
{
    let (namespace, key, request) = match kind {
        OpKind::Claim => {
            let r = ClaimReq::deserialize(de).map_err(json_problem)?;
            let request = Request::Claim(ClaimOptions {
                ttl_ms: duration(r.ttl_ms.map(RawValue::get), "ttl_ms")?,
                lease_ms: duration(r.lease_ms.map(RawValue::get), "lease_ms")?,
                fingerprint: r.fingerprint,
                owner: r.owner,
            });
            (r.namespace, r.key, request)
        }
        OpKind::Complete => {
            let r = CompleteReq::deserialize(de).map_err(json_problem)?;
            let request = Request::Complete {
                token: Token::new(r.token),
                opts: CompleteOptions {
                    result: r.result,
                    ttl_ms: duration(r.ttl_ms.map(RawValue::get), "ttl_ms")?,
                },
            };
            (r.namespace, r.key, request)
        }
        OpKind::Release => {
            let r = ReleaseReq::deserialize(de).map_err(json_problem)?;
            let request = Request::Release {
                token: Token::new(r.token),
            };
            (r.namespace, r.key, request)
        }
        OpKind::Extend => {
            let r = ExtendReq::deserialize(de).map_err(json_problem)?;
            let request = Request::Extend {
                token: Token::new(r.token),
                lease_ms: required_duration(r.lease_ms.map(RawValue::get), "lease_ms")?,
            };
            (r.namespace, r.key, request)
        }
        OpKind::Mark => {
            let r = MarkReq::deserialize(de).map_err(json_problem)?;
            let request = Request::Mark(MarkOptions {
                ttl_ms: duration(r.ttl_ms.map(RawValue::get), "ttl_ms")?,
                fingerprint: r.fingerprint,
                result: r.result,
            });
            (r.namespace, r.key, request)
        }
        OpKind::Get | OpKind::Forget => {
            let r = RecordReq::deserialize(de).map_err(json_problem)?;
            let request = if kind == OpKind::Get {
                Request::Get
            } else {
                Request::Forget
            };
            (r.namespace, r.key, request)
        }
    };
    let id = record_id(namespace, key, limits)?;
    let op = valid_op(request, defaults, limits)?;
    Ok(Parsed { kind, id, op })
}

/// Validates an identity against the contract and the configured (possibly lower) limits.
pub fn record_id(namespace: String, key: String, limits: &Limits) -> Result<RecordId, Problem> {
    if namespace.len() > limits.namespace_bytes_max {
        return Err(Problem::invalid(format!(
            "namespace: must be at most {} bytes, got {}",
            limits.namespace_bytes_max,
            namespace.len()
        )));
    }
    if key.len() > limits.key_bytes_max {
        return Err(Problem::invalid(format!(
            "key: must be at most {} bytes, got {}",
            limits.key_bytes_max,
            key.len()
        )));
    }
    RecordId::new(namespace, key).map_err(|e| Problem::invalid(e.to_string()))
}

/// The operation `request` asks for, built (defaults applied, fields checked) by the core, then
/// held to the configured result size, so a refused op never reaches the store.
fn valid_op(request: Request, defaults: &Defaults, limits: &Limits) -> Result<ValidOp, Problem> {
    let op =
        ValidOp::from_request(request, *defaults).map_err(|e| Problem::invalid(e.to_string()))?;
    let result = match &*op {
        Op::Complete { result, .. } | Op::Mark { result, .. } => result.as_ref(),
        _ => None,
    };
    if let Some(value) = result {
        let mut counter = ByteCounter(0);
        serde_json::to_writer(&mut counter, value).map_err(json_problem)?;
        if counter.0 > limits.result_bytes_max {
            return Err(Problem::too_large(format!(
                "result: must be at most {} bytes of JSON, got {}",
                limits.result_bytes_max, counter.0
            )));
        }
    }
    Ok(op)
}

struct ByteCounter(usize);

impl std::io::Write for ByteCounter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Writes an outcome's success body (API.md's table) to `out`. `Found(None)` is 404 `not_found`.
pub fn write_outcome(out: &mut Vec<u8>, outcome: &Outcome) -> Result<(), Problem> {
    use serde_json::to_writer;
    let written = match outcome {
        Outcome::Claimed(Claim::New(lease)) => {
            write_new_lease(out, lease);
            Ok(())
        }
        Outcome::Claimed(claim) => to_writer(&mut *out, claim),
        Outcome::Completed(record) => {
            out.extend_from_slice(b"{\"record\":");
            to_writer(&mut *out, record).map(|()| out.push(b'}'))
        }
        Outcome::Released => {
            out.extend_from_slice(b"{\"released\":true}");
            Ok(())
        }
        Outcome::Extended {
            lease_expires_at_ms,
        } => {
            out.extend_from_slice(b"{\"lease_expires_at_ms\":");
            write_u64(out, *lease_expires_at_ms);
            out.push(b'}');
            Ok(())
        }
        Outcome::Marked(mark) => to_writer(&mut *out, mark),
        Outcome::Found(Some(record)) => to_writer(&mut *out, record),
        Outcome::Found(None) => return Err(Problem::not_found("no live record for this key")),
        Outcome::Forgotten(deleted) => {
            out.extend_from_slice(if *deleted {
                b"{\"deleted\":true}"
            } else {
                b"{\"deleted\":false}"
            });
            Ok(())
        }
    };
    written.map_err(|e| Problem::unavailable(format!("could not render the answer: {e}")))
}

/// `Claim::New` as serde writes it (`{"outcome":"new","token",…}`), without serde's per-byte
/// escaping: the answer to most claims, so it is written by hand.
fn write_new_lease(out: &mut Vec<u8>, lease: &Lease) {
    out.extend_from_slice(b"{\"outcome\":\"new\",\"token\":");
    write_str(out, lease.token.as_str());
    out.extend_from_slice(b",\"fence\":");
    write_u64(out, lease.fence);
    out.extend_from_slice(b",\"lease_expires_at_ms\":");
    write_u64(out, lease.lease_expires_at_ms);
    out.extend_from_slice(b",\"expires_at_ms\":");
    write_u64(out, lease.expires_at_ms);
    out.push(b'}');
}

/// A JSON string: copied as is when nothing needs escaping (generated tokens are hex), else
/// escaped by serde_json.
fn write_str(out: &mut Vec<u8>, s: &str) {
    if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        serde_json::to_writer(&mut *out, s).expect("writing a str to a Vec never fails");
    }
}

fn write_u64(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(kind: OpKind, body: &str) -> Result<Parsed, Problem> {
        parse_body(
            kind,
            body.as_bytes(),
            &Defaults::default(),
            &Limits::default(),
        )
    }

    #[test]
    fn claim_defaults_and_unknown_fields() {
        let p = parse(
            OpKind::Claim,
            r#"{"namespace":"n","key":"k","extra":[1,2]}"#,
        )
        .unwrap();
        assert_eq!(
            *p.op,
            Op::Claim {
                ttl_ms: Defaults::default().ttl_ms,
                lease_ms: Defaults::default().lease_ms,
                fingerprint: None,
                owner: None
            }
        );
    }

    #[test]
    fn bad_bodies_are_400() {
        for body in [
            "",
            "{",
            "[]",
            r#"{"namespace":"n"}"#,
            r#"{"namespace":"n","key":""}"#,
            r#"{"namespace":"n n","key":"k"}"#,
            r#"{"namespace":"n","key":5}"#,
            r#"{"namespace":"n","key":"k","ttl_ms":0}"#,
            r#"{"namespace":"n","key":"k","ttl_ms":-1}"#,
            r#"{"namespace":"n","key":"k","lease_ms":1.5}"#,
            r#"{"namespace":"n","key":"k","ttl_ms":"5"}"#,
            r#"{"namespace":"n","key":"k"} trailing"#,
        ] {
            let p = parse(OpKind::Claim, body).unwrap_err();
            assert_eq!((p.status, p.code), (400, "invalid_request"), "{body}");
        }
    }

    #[test]
    fn whole_numbers_are_read_exactly() {
        use Whole::*;
        for (text, want) in [
            ("0", Value(0)),
            ("-0", Value(0)),
            ("-0.0e-5", Value(0)),
            ("0e99999999999999999999", Value(0)),
            ("60000.0", Value(60_000)),
            ("6e4", Value(60_000)),
            ("6E+4", Value(60_000)),
            ("600000e-1", Value(60_000)),
            ("0.6e5", Value(60_000)),
            ("1e0", Value(1)),
            ("1e-0", Value(1)),
            ("10e-1", Value(1)),
            ("9007199254740993.0", Value(9_007_199_254_740_993)),
            ("18446744073709551615", Value(u64::MAX)),
            ("1.8446744073709551615e19", Value(u64::MAX)),
            ("18446744073709551616", TooLarge),
            ("1e20", TooLarge),
            ("1e99999999999999999999", TooLarge),
            ("1.0000000000000001", Fraction),
            ("1e-99999999999999999999", Fraction),
            ("0.5", Fraction),
            ("-5", Negative),
            ("-0.5", Negative),
        ] {
            assert_eq!(whole_number(text), Some(want), "{text}");
        }
        for text in [
            "", "-", "1.", ".1", "e5", "1e", "1e+", "abc", "\"5\"", "--1", "1.2.3", "1e5e5",
            "true", "null", "{}", "[1]", "1 ", "+1",
        ] {
            assert_eq!(whole_number(text), None, "{text}");
        }
        // Anything else: an answer, never a panic.
        let alphabet = b"0123456789.eE+- 9";
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (x % 30) as usize;
            let text: String = (0..len)
                .map(|i| alphabet[((x >> (i % 60)) as usize + i) % alphabet.len()] as char)
                .collect();
            let _ = whole_number(&text);
            let _ = duration(Some(&text), "ttl_ms");
        }
    }

    #[test]
    fn hand_written_answers_match_serde() {
        for token in [
            "5b012bf606e8fc464c616b292bfa03c5",
            "quote\"back\\slash\u{1}é",
        ] {
            for fence in [0, 7, u64::MAX] {
                let claim = Claim::New(Lease {
                    token: Token::new(token),
                    fence,
                    lease_expires_at_ms: 1_764_000_030_000,
                    expires_at_ms: 10,
                });
                let mut out = Vec::new();
                write_outcome(&mut out, &Outcome::Claimed(claim.clone())).unwrap();
                assert_eq!(out, serde_json::to_vec(&claim).unwrap());
            }
        }
        let mut out = Vec::new();
        write_outcome(
            &mut out,
            &Outcome::Extended {
                lease_expires_at_ms: 123,
            },
        )
        .unwrap();
        write_outcome(&mut out, &Outcome::Forgotten(false)).unwrap();
        assert_eq!(out, br#"{"lease_expires_at_ms":123}{"deleted":false}"#);
    }

    #[test]
    fn big_results_are_413() {
        let big = "x".repeat(Limits::default().result_bytes_max);
        let body = format!(r#"{{"namespace":"n","key":"k","result":"{big}"}}"#);
        assert_eq!(parse(OpKind::Mark, &body).unwrap_err().status, 413);
    }

    #[test]
    fn batch_items() {
        let d = Defaults::default();
        let l = Limits::default();
        let raw = |v: Value| RawValue::from_string(v.to_string()).unwrap();
        let ok = serde_json::json!({"op":"release","namespace":"n","key":"k","token":"t"});
        assert_eq!(parse_item(&raw(ok), &d, &l).unwrap().kind, OpKind::Release);
        // A field the op does not take is ignored whatever its type; escaped names count.
        let claim = parse_item(
            &raw(serde_json::json!({"op":"claim","token":5,"result":{"a":[1]},"namespace":"n","key":"k","ttl_ms":null})),
            &d,
            &l,
        )
        .unwrap();
        assert_eq!(claim.kind, OpKind::Claim);
        assert_eq!(
            *claim.op,
            Op::Claim {
                ttl_ms: d.ttl_ms,
                lease_ms: d.lease_ms,
                fingerprint: None,
                owner: None
            }
        );
        let escaped = RawValue::from_string(
            r#"{"\u006fp":"mark","namespace":"n","k\u0065y":"k\"q","result":[1,{"x":null}]}"#
                .to_owned(),
        )
        .unwrap();
        let mark = parse_item(&escaped, &d, &l).unwrap();
        assert_eq!(mark.id.key.as_str(), "k\"q");
        assert_eq!(
            *mark.op,
            Op::Mark {
                ttl_ms: d.ttl_ms,
                fingerprint: None,
                result: Some(serde_json::json!([1, {"x": null}]))
            }
        );
        for bad in [
            serde_json::json!(null),
            serde_json::json!("claim"),
            serde_json::json!([{"op":"claim"}]),
            serde_json::json!(true),
            serde_json::json!({"op":7,"namespace":"n","key":"k"}),
            serde_json::json!({"op":"claim","namespace":"n","key":7}),
            serde_json::json!({"op":"claim","namespace":"n","key":"k","ttl_ms":"1"}),
            serde_json::json!({"op":"claim","namespace":"n","key":"k","ttl_ms":0}),
            serde_json::json!({"op":"claim","namespace":"n"}),
            serde_json::json!({"op":"complete","namespace":"n","key":"k"}),
            serde_json::json!({"op":"explode","namespace":"n","key":"k"}),
            serde_json::json!({"namespace":"n","key":"k"}),
            serde_json::json!(7),
            serde_json::json!({"op":"extend","namespace":"n","key":"k","token":"t"}),
        ] {
            assert_eq!(
                parse_item(&raw(bad.clone()), &d, &l).unwrap_err().status,
                400,
                "{bad}"
            );
        }
        let twice = RawValue::from_string(
            r#"{"op":"claim","namespace":"n","key":"k","key":"j"}"#.to_owned(),
        )
        .unwrap();
        assert_eq!(parse_item(&twice, &d, &l).unwrap_err().status, 400);
    }

    /// What serde_json alone reads from a batch body (the reference for [`scan_batch`]).
    fn serde_batch(body: &str) -> Option<Vec<BatchItem<'_>>> {
        #[derive(Deserialize)]
        struct BatchReq<'a> {
            #[serde(borrow)]
            ops: Vec<BatchItem<'a>>,
        }
        serde_json::from_str::<BatchReq<'_>>(body)
            .ok()
            .map(|r| r.ops)
    }

    #[test]
    fn batch_scanner_reads_what_serde_reads() {
        let common = r#"{"ops":[{"op":"claim","namespace":"bench","key":"1-2:1:7","ttl_ms":86400000},
            {"op":"release","namespace":"n","key":"k","token":"t","x":null,"key":"j"}, {} ]}"#;
        let fast = scan_batch(common).expect("the common shape takes the fast path");
        assert_eq!(Some(fast), serde_batch(common));
        assert_eq!(
            scan_batch(common).unwrap()[1].refused,
            Some(DUPLICATE_FIELD)
        );
        // Random bodies from fragments, valid and not: whenever the scanner reads one, serde
        // must read the same items; whenever serde refuses one, so must the scanner.
        let names = [
            "op",
            "namespace",
            "key",
            "token",
            "ttl_ms",
            "lease_ms",
            "owner",
            "result",
            "zz",
            "k\\u0065y",
            "",
        ];
        let values = [
            "\"claim\"",
            "\"a b\"",
            "\"\"",
            "0",
            "00",
            "12",
            "18446744073709551616",
            "null",
            "nul",
            "nullx",
            "1.5",
            "1e3",
            "-1",
            "true",
            "{}",
            "[1]",
            "\"\\n\"",
            "\"é\"",
            "\"\u{1}\"",
        ];
        // values[..PLAIN_VALUES] are in the scanner's shape, the rest are not.
        const PLAIN_VALUES: usize = 10;
        let ws = ["", "", " ", "\n\t", "\r"];
        let seed: u64 = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1;
        eprintln!("batch scanner seed {seed}");
        let mut x = seed;
        let mut next = |n: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n as u64) as usize
        };
        let (mut fast_reads, mut bodies) = (0, 0);
        for _ in 0..20_000 {
            let mut outside = false;
            let mut body = format!(
                "{}{{{}\"ops\"{}:{}[",
                ws[next(5)],
                ws[next(5)],
                ws[next(5)],
                ws[next(5)]
            );
            for i in 0..next(4) {
                if i > 0 {
                    body.push_str([",", ",", ",", ",,", ""][next(5)]);
                }
                body.push('{');
                for j in 0..next(5) {
                    if j > 0 {
                        body.push_str([",", ",", ",", ""][next(4)]);
                    }
                    let colon = [":", ":", ":", ""][next(4)];
                    let (name, value) = (next(names.len()), next(values.len()));
                    outside |= names[name].contains('\\') || value >= PLAIN_VALUES;
                    body.push_str(&format!(
                        "{}\"{}\"{}{}{}{}",
                        ws[next(5)],
                        names[name],
                        ws[next(5)],
                        colon,
                        ws[next(5)],
                        values[value]
                    ));
                }
                body.push_str(["}", "}", "}", ""][next(4)]);
            }
            let ending = next(6);
            body.push_str(["]}", "]}", "] } ", "]}x", "],\"a\":1}", "]"][ending]);
            outside |= ending == 4;
            bodies += 1;
            let reference = serde_batch(&body);
            match scan_batch(&body) {
                Some(items) => {
                    fast_reads += 1;
                    assert_eq!(Some(items), reference, "seed {seed}: {body}");
                }
                None => assert!(
                    reference.is_none() || outside,
                    "seed {seed}: serde reads a plain body the scanner refused: {body}"
                ),
            }
        }
        assert!(
            fast_reads > bodies / 20,
            "seed {seed}: {fast_reads} of {bodies} read fast"
        );
    }
}

#[cfg(test)]
mod query_tests {
    use super::*;

    #[test]
    fn record_queries_decode_exactly_or_are_refused() {
        let q = record_query(Some("namespace=t4&key=a%20b+c%E2%82%AC%zz&x=%FF")).unwrap();
        assert_eq!((q.namespace.as_str(), q.key.as_str()), ("t4", "a b c€%zz"));
        for bad in [
            "namespace=t4&key=%FF",
            "namespace=t4&key=%FE",
            "namespace=%C3&key=k",
            "namespace=t4",
            "key=k",
            "namespace=t4&key=a&key=b",
        ] {
            let problem = record_query(Some(bad)).unwrap_err();
            assert_eq!(problem.status, 400, "{bad}: {problem:?}");
        }
        assert!(record_query(None).is_err());
    }
}
