//! One field of a request typed from its raw JSON text (durations, strings, options), each
//! refusal worded in JSON's terms and naming the field.

use serde::Deserialize;

use crate::problem::Problem;

pub(super) fn json_problem(e: serde_json::Error) -> Problem {
    Problem::invalid(format!("malformed request: {}", json_words(&e)))
}

/// serde_json's message for `e` in JSON's words: serde calls an object a map and an array a
/// sequence.
pub(super) fn json_words(e: &serde_json::Error) -> String {
    e.to_string()
        .replace("invalid type: map,", "invalid type: object,")
        .replace("invalid type: sequence,", "invalid type: array,")
        .replace("expected a sequence", "expected an array")
        .replace("expected a map", "expected an object")
}

/// Refuses a body whose JSON value is not an object. serde reads a struct from an array too
/// (`["ns","k",60000]` would be a claim), and its error for other values names the Rust type.
/// Malformed text is left to serde_json, which says where it breaks.
pub(super) fn must_be_object(body: &[u8], shape: &str) -> Result<(), Problem> {
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

/// A field the op takes, typed from its raw text; `null` counts as absent.
pub(super) fn opt_field<'a, T: Deserialize<'a>>(
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
pub(super) fn required_duration(raw: Option<&str>, name: &str) -> Result<u64, Problem> {
    duration(raw, name)?.ok_or_else(|| {
        Problem::invalid(format!(
            "malformed request: missing field `{name}` (a whole number of milliseconds)"
        ))
    })
}

/// A duration field's raw JSON text (absent or `null`: `None`). A number with no fractional
/// part is its value whatever its spelling (`60000`, `60000.0`, `6e4`: JavaScript and Python
/// clients send floats); fractions, negatives, numbers past `u64` and other types are refused,
/// naming the field. Zero and values past the maximum are left to the core (`ValidOp`'s builders).
pub(super) fn duration(raw: Option<&str>, name: &str) -> Result<Option<u64>, Problem> {
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
pub(super) fn plain_str(raw: &str) -> Option<&str> {
    raw.strip_prefix('"')?
        .strip_suffix('"')
        .filter(|s| !s.contains('\\'))
}

/// A string field the op needs.
pub(super) fn req_string(raw: Option<&str>, name: &str) -> Result<String, Problem> {
    match raw.and_then(plain_str) {
        Some(s) => Ok(s.to_owned()),
        None => req_field(raw, name),
    }
}

/// A field the op needs.
pub(super) fn req_field<'a, T: Deserialize<'a>>(
    raw: Option<&'a str>,
    name: &str,
) -> Result<T, Problem> {
    match raw {
        None => Err(Problem::invalid(format!(
            "malformed request: missing field `{name}`"
        ))),
        Some(raw) => serde_json::from_str::<T>(raw).map_err(|e| {
            Problem::invalid(format!("malformed request: {name}: {}", json_words(&e)))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
