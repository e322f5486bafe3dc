//! A batch body, `{"ops":[…]}`, read into its items in one pass (by hand for the common shape,
//! else by serde_json), and each item typed into a request for the op it names.

use dedupgate_core::{ClaimOptions, CompleteOptions, Defaults, MarkOptions, Request, Token};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::fields::{
    duration, json_words, must_be_object, opt_field, plain_str, req_string, required_duration,
};
use super::{record_id, valid_op, OpKind, Parsed};
use crate::config::Limits;
use crate::problem::Problem;

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

#[cfg(test)]
mod tests {
    use super::*;
    use dedupgate_core::Op;

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
