//! Key templates (API.md "Key templates"): `{asset}_{signal}_{ts|window:5m}` parsed once into a
//! [`KeyTemplate`], then rendered against each JSON event.
//!
//! Syntax:
//! - `{path}` inserts a scalar field of the event. `path` is a dot path (`order.id`,
//!   `headers.x` for a message header); a segment that is a number indexes an array.
//! - `{path|filter|filter…}` passes the value through filters, left to right:
//!   `window:DURATION` floors a timestamp (RFC 3339, or epoch seconds/milliseconds; see
//!   [`super::epoch_to_ms`] for how they are told apart) to the start of its window, counted
//!   from the unix epoch in UTC, and writes it as RFC 3339 UTC with `Z` (with milliseconds only
//!   when the window is not a whole number of seconds); `sha256` writes the lowercase hex
//!   SHA-256 of the text; `lower` lowercases it.
//! - `{now}` is the current time given by the caller (so renders are testable); `now` is
//!   therefore not available as a field name. `{now|window:1d}` names the current day.
//! - `{{` and `}}` write literal braces.
//!
//! Values: strings are inserted as they are, numbers as written in the event (with serde_json's
//! `arbitrary_precision`, digits are kept), booleans as `true`/`false`. A null, an object or an
//! array is refused with an error naming the field: a key made from them would be a guess.

use std::fmt::Write as _;

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::time::{
    epoch_int_to_ms, epoch_to_ms, format_rfc3339_ms, parse_duration_ms, parse_timestamp_ms,
    DurationError, TimestampError,
};

/// Why a template could not be parsed. Positions are byte offsets into the template.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TemplateError {
    /// A `{` with no matching `}`.
    #[error("key template: '{{' at byte {at} is never closed (write '{{{{' for a literal brace)")]
    Unclosed {
        /// Byte offset of the `{`.
        at: usize,
    },
    /// A `}` outside a placeholder.
    #[error("key template: '}}' at byte {at} closes nothing (write '}}}}' for a literal brace)")]
    Unopened {
        /// Byte offset of the `}`.
        at: usize,
    },
    /// `{` inside a placeholder.
    #[error("key template: '{{' at byte {at} is inside another placeholder")]
    Nested {
        /// Byte offset of the inner `{`.
        at: usize,
    },
    /// `{}` or `{|lower}`.
    #[error("key template: the placeholder at byte {at} names no field")]
    EmptyField {
        /// Byte offset of the placeholder.
        at: usize,
    },
    /// `{a..b}`, `{.a}`.
    #[error("key template: field path {path:?} has an empty segment")]
    EmptySegment {
        /// The path.
        path: String,
    },
    /// `{x|}`.
    #[error("key template: empty filter in the placeholder at byte {at}")]
    EmptyFilter {
        /// Byte offset of the placeholder.
        at: usize,
    },
    /// A filter other than window, sha256, lower.
    #[error("key template: unknown filter {name:?} (filters: window:DURATION, sha256, lower)")]
    UnknownFilter {
        /// The filter named.
        name: String,
    },
    /// `window` without a duration, or `sha256:x`.
    #[error("key template: filter {name:?} {problem}")]
    FilterArgument {
        /// The filter named.
        name: String,
        /// What is wrong with its argument.
        problem: &'static str,
    },
    /// `window:5x`.
    #[error("key template: window duration: {0}")]
    Duration(DurationError),
    /// No placeholder and no text.
    #[error("key template is empty")]
    Empty,
}

// By hand rather than `#[from]`: the message already holds the cause, so it is not also the
// error's source (a report walking the sources would say it twice).
impl From<DurationError> for TemplateError {
    fn from(e: DurationError) -> Self {
        TemplateError::Duration(e)
    }
}

/// Why a template could not be rendered for one event. Each names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RenderError {
    /// The event has no such field.
    #[error("missing field `{field}`")]
    MissingField {
        /// The dot path.
        field: String,
    },
    /// The field is null.
    #[error("field `{field}` is null")]
    Null {
        /// The dot path.
        field: String,
    },
    /// The field is an object or an array.
    #[error("field `{field}` is {found}, not a string, number or boolean")]
    NotScalar {
        /// The dot path.
        field: String,
        /// "an object" or "an array".
        found: &'static str,
    },
    /// The event itself is not a JSON object.
    #[error("the event is {found}, not a JSON object")]
    NotAnObject {
        /// What it is.
        found: &'static str,
    },
    /// `window` got something that is not a timestamp.
    #[error("field `{field}`: {cause}")]
    Timestamp {
        /// The dot path.
        field: String,
        /// Why the value is not a timestamp (in the message, so not also the error's source).
        cause: TimestampError,
    },
}

/// A filter of a placeholder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Filter {
    /// Floor to the window start and write RFC 3339.
    Window { window_ms: u64 },
    /// Lowercase hex SHA-256 of the UTF-8 text.
    Sha256,
    /// Unicode lowercase.
    Lower,
}

/// Where a placeholder's value comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// The caller's current time.
    Now,
    /// A dot path into the event; `label` is the path as written, for errors.
    Field {
        segments: Vec<String>,
        label: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    Placeholder {
        source: Source,
        filters: Vec<Filter>,
    },
}

/// A parsed key template: parse once with [`KeyTemplate::parse`], render per event.
///
/// ```
/// use dedupgate_core::keys::KeyTemplate;
/// let t = KeyTemplate::parse("{asset}_{signal}_{ts|window:5m}").unwrap();
/// let event = serde_json::json!({"asset": "ETH", "signal": "momentum", "ts": "2026-03-01T14:32:10Z"});
/// assert_eq!(t.render(&event, 0).unwrap(), "ETH_momentum_2026-03-01T14:30:00Z");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyTemplate {
    parts: Vec<Part>,
    source: String,
}

/// A value on its way through the filters.
enum Scalar<'a> {
    Text(&'a str),
    Number(&'a str),
    Instant(i64),
    Owned(String),
}

impl KeyTemplate {
    /// Parses a template.
    pub fn parse(template: &str) -> Result<Self, TemplateError> {
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = template.char_indices().peekable();
        while let Some((at, c)) = chars.next() {
            match c {
                '{' if chars.peek().map(|&(_, n)| n) == Some('{') => {
                    chars.next();
                    literal.push('{');
                }
                '}' if chars.peek().map(|&(_, n)| n) == Some('}') => {
                    chars.next();
                    literal.push('}');
                }
                '}' => return Err(TemplateError::Unopened { at }),
                '{' => {
                    let body_start = at + 1;
                    let mut body_end = None;
                    for (j, n) in chars.by_ref() {
                        match n {
                            '}' => {
                                body_end = Some(j);
                                break;
                            }
                            '{' => return Err(TemplateError::Nested { at: j }),
                            _ => {}
                        }
                    }
                    let body_end = body_end.ok_or(TemplateError::Unclosed { at })?;
                    if !literal.is_empty() {
                        parts.push(Part::Literal(std::mem::take(&mut literal)));
                    }
                    parts.push(parse_placeholder(&template[body_start..body_end], at)?);
                }
                other => literal.push(other),
            }
        }
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        if parts.is_empty() {
            return Err(TemplateError::Empty);
        }
        Ok(Self {
            parts,
            source: template.to_owned(),
        })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// True when the template reads no event field (only `{now}` and text), as a cron key does.
    pub fn is_event_free(&self) -> bool {
        self.parts.iter().all(|p| match p {
            Part::Literal(_) => true,
            Part::Placeholder { source, .. } => *source == Source::Now,
        })
    }

    /// Renders the key for `event`, with `now_ms` (unix milliseconds) as `{now}`.
    pub fn render(&self, event: &Value, now_ms: i64) -> Result<String, RenderError> {
        let mut out = String::new();
        self.render_into(event, now_ms, &mut out)?;
        Ok(out)
    }

    /// Renders into `out` (cleared first), so a caller rendering many events reuses one buffer.
    /// On error `out` holds a partial key and must not be used.
    pub fn render_into(
        &self,
        event: &Value,
        now_ms: i64,
        out: &mut String,
    ) -> Result<(), RenderError> {
        out.clear();
        let needs_object = !self.is_event_free();
        if needs_object && !event.is_object() {
            return Err(RenderError::NotAnObject { found: kind(event) });
        }
        for part in &self.parts {
            match part {
                Part::Literal(text) => out.push_str(text),
                Part::Placeholder { source, filters } => {
                    let (mut value, label) = match source {
                        Source::Now => (Scalar::Instant(now_ms), "now"),
                        Source::Field { segments, label } => {
                            (lookup(event, segments, label)?, label.as_str())
                        }
                    };
                    for filter in filters {
                        value = apply(*filter, value, label)?;
                    }
                    match value {
                        Scalar::Text(s) | Scalar::Number(s) => out.push_str(s),
                        Scalar::Owned(s) => out.push_str(&s),
                        Scalar::Instant(ms) => out.push_str(&render_instant(ms, true, label)?),
                    }
                }
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for KeyTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.source)
    }
}

impl std::str::FromStr for KeyTemplate {
    type Err = TemplateError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

fn parse_placeholder(body: &str, at: usize) -> Result<Part, TemplateError> {
    let mut pieces = body.split('|');
    let path = pieces.next().unwrap_or("").trim();
    if path.is_empty() {
        return Err(TemplateError::EmptyField { at });
    }
    let source = if path == "now" {
        Source::Now
    } else {
        let segments: Vec<String> = path.split('.').map(|s| s.trim().to_owned()).collect();
        if segments.iter().any(String::is_empty) {
            return Err(TemplateError::EmptySegment {
                path: path.to_owned(),
            });
        }
        Source::Field {
            segments,
            label: path.to_owned(),
        }
    };
    let mut filters = Vec::new();
    for piece in pieces {
        let piece = piece.trim();
        if piece.is_empty() {
            return Err(TemplateError::EmptyFilter { at });
        }
        let (name, arg) = match piece.split_once(':') {
            Some((n, a)) => (n.trim(), Some(a.trim())),
            None => (piece, None),
        };
        let no_arg = |f: Filter| match arg {
            None => Ok(f),
            Some(_) => Err(TemplateError::FilterArgument {
                name: name.to_owned(),
                problem: "takes no argument",
            }),
        };
        filters.push(match name {
            "window" => match arg {
                Some(a) if !a.is_empty() => Filter::Window {
                    window_ms: parse_duration_ms(a)?,
                },
                _ => {
                    return Err(TemplateError::FilterArgument {
                        name: name.to_owned(),
                        problem: "needs a duration, e.g. window:5m",
                    })
                }
            },
            "sha256" => no_arg(Filter::Sha256)?,
            "lower" => no_arg(Filter::Lower)?,
            other => {
                return Err(TemplateError::UnknownFilter {
                    name: other.to_owned(),
                })
            }
        });
    }
    Ok(Part::Placeholder { source, filters })
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

fn lookup<'a>(
    event: &'a Value,
    segments: &[String],
    label: &str,
) -> Result<Scalar<'a>, RenderError> {
    let missing = || RenderError::MissingField {
        field: label.to_owned(),
    };
    let mut at = event;
    for seg in segments {
        at = match at {
            Value::Object(map) => map.get(seg.as_str()).ok_or_else(missing)?,
            Value::Array(items) => seg
                .parse::<usize>()
                .ok()
                .and_then(|i| items.get(i))
                .ok_or_else(missing)?,
            _ => return Err(missing()),
        };
    }
    match at {
        Value::String(s) => Ok(Scalar::Text(s)),
        Value::Number(n) => Ok(Scalar::Number(number_text(n))),
        Value::Bool(true) => Ok(Scalar::Text("true")),
        Value::Bool(false) => Ok(Scalar::Text("false")),
        Value::Null => Err(RenderError::Null {
            field: label.to_owned(),
        }),
        other => Err(RenderError::NotScalar {
            field: label.to_owned(),
            found: kind(other),
        }),
    }
}

/// The text of a number as the event wrote it (serde_json keeps it with `arbitrary_precision`).
fn number_text(n: &serde_json::Number) -> &str {
    n.as_str()
}

fn render_instant(ms: i64, with_ms: bool, label: &str) -> Result<String, RenderError> {
    format_rfc3339_ms(ms, with_ms).ok_or_else(|| RenderError::Timestamp {
        field: label.to_owned(),
        cause: TimestampError::OutOfRange {
            input: ms.to_string(),
        },
    })
}

fn apply<'a>(filter: Filter, value: Scalar<'a>, label: &str) -> Result<Scalar<'a>, RenderError> {
    let ts_err = |cause| RenderError::Timestamp {
        field: label.to_owned(),
        cause,
    };
    Ok(match filter {
        Filter::Window { window_ms } => {
            let ms = match &value {
                Scalar::Instant(ms) => *ms,
                Scalar::Number(n) => number_to_ms(n).map_err(ts_err)?,
                Scalar::Text(s) => parse_timestamp_ms(s).map_err(ts_err)?,
                Scalar::Owned(s) => parse_timestamp_ms(s).map_err(ts_err)?,
            };
            // window_ms <= ten years, so the cast and the floor cannot overflow.
            let window = window_ms as i64;
            let start = ms.div_euclid(window) * window;
            Scalar::Owned(render_instant(start, window_ms % 1000 != 0, label)?)
        }
        Filter::Sha256 => {
            let text = scalar_text(&value, label)?;
            let digest = Sha256::digest(text.as_bytes());
            let mut hex = String::with_capacity(64);
            for b in digest {
                let _ = write!(hex, "{b:02x}");
            }
            Scalar::Owned(hex)
        }
        Filter::Lower => Scalar::Owned(scalar_text(&value, label)?.to_lowercase()),
    })
}

fn scalar_text<'a>(
    value: &'a Scalar<'_>,
    label: &str,
) -> Result<std::borrow::Cow<'a, str>, RenderError> {
    Ok(match value {
        Scalar::Text(s) | Scalar::Number(s) => (*s).into(),
        Scalar::Owned(s) => s.as_str().into(),
        Scalar::Instant(ms) => render_instant(*ms, true, label)?.into(),
    })
}

/// Reads an epoch number exactly when it is an integer, through f64 when it has a fraction.
fn number_to_ms(text: &str) -> Result<i64, TimestampError> {
    if !text.contains(['.', 'e', 'E']) {
        if let Ok(v) = text.parse::<i128>() {
            return epoch_int_to_ms(v, text);
        }
    }
    match text.parse::<f64>() {
        Ok(v) => epoch_to_ms(v, text),
        Err(_) => Err(TimestampError::Malformed {
            input: text.to_owned(),
            reason: "not a number",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NOW_MS: i64 = 1_772_375_530_123; // 2026-03-01T14:32:10.123Z

    fn render(t: &str, event: &Value) -> Result<String, RenderError> {
        KeyTemplate::parse(t).unwrap().render(event, NOW_MS)
    }

    #[test]
    fn the_api_example() {
        let e = json!({"asset": "ETH", "signal": "momentum", "ts": "2026-03-01T14:32:10Z"});
        assert_eq!(
            render("{asset}_{signal}_{ts|window:5m}", &e).unwrap(),
            "ETH_momentum_2026-03-01T14:30:00Z"
        );
    }

    #[test]
    fn timestamps_of_every_form_floor_to_the_same_window() {
        for ts in [
            json!("2026-03-01T14:34:59.999Z"),
            json!("2026-03-01T15:30:00+01:00"),
            json!("2026-03-01t14:30:00z"),
            json!(1_772_375_400),
            json!(1_772_375_699.5),
            json!(1_772_375_400_000u64),
            json!("1772375400"),
            json!("1772375699999"),
        ] {
            assert_eq!(
                render("{ts|window:5m}", &json!({ "ts": ts })).unwrap(),
                "2026-03-01T14:30:00Z",
                "{ts}"
            );
        }
        assert_eq!(
            render(
                "{ts|window:500ms}",
                &json!({"ts": "2026-03-01T14:30:00.700Z"})
            )
            .unwrap(),
            "2026-03-01T14:30:00.500Z"
        );
        assert_eq!(
            render("{ts|window:7d}", &json!({"ts": 0})).unwrap(),
            "1970-01-01T00:00:00Z"
        );
        assert_eq!(
            render("{ts|window:1h}", &json!({"ts": "1969-12-31T23:59:59Z"})).unwrap(),
            "1969-12-31T23:00:00Z"
        );
    }

    #[test]
    fn now_filters_chains_and_escapes() {
        let e = json!({"user": {"Name": "ÀLICE"}, "headers": {"x": "H1"}, "n": 12345678901234567890123u128, "ok": true, "list": ["a", "b"]});
        assert_eq!(
            render("{now|window:1d}", &e).unwrap(),
            "2026-03-01T00:00:00Z"
        );
        assert_eq!(render("{now}", &e).unwrap(), "2026-03-01T14:32:10.123Z");
        assert_eq!(
            render("backup_{now|window:1d}", &Value::Null).unwrap(),
            "backup_2026-03-01T00:00:00Z"
        );
        assert_eq!(render("{user.Name|lower}", &e).unwrap(), "àlice");
        assert_eq!(
            render("{headers.x}:{n}:{ok}:{list.1}", &e).unwrap(),
            "H1:12345678901234567890123:true:b"
        );
        assert_eq!(
            render("{user.Name|lower|sha256}", &e).unwrap(),
            hex_sha("àlice")
        );
        assert_eq!(
            render("{now|window:1d|sha256}", &e).unwrap(),
            hex_sha("2026-03-01T00:00:00Z")
        );
        assert_eq!(render("{{{headers.x}}}", &e).unwrap(), "{H1}");
        assert_eq!(render(" { headers.x | lower } ", &e).unwrap(), " h1 ");
    }

    fn hex_sha(s: &str) -> String {
        hex::encode(Sha256::digest(s.as_bytes()))
    }

    #[test]
    fn parse_errors_are_precise() {
        use TemplateError::*;
        let err = |t: &str| KeyTemplate::parse(t).unwrap_err();
        assert_eq!(err("a{b"), Unclosed { at: 1 });
        assert_eq!(err("a}b"), Unopened { at: 1 });
        assert_eq!(err("{a{b}}"), Nested { at: 2 });
        assert_eq!(err("x{}"), EmptyField { at: 1 });
        assert_eq!(err("{|lower}"), EmptyField { at: 0 });
        assert!(matches!(err("{a..b}"), EmptySegment { .. }));
        assert_eq!(err("{a|}"), EmptyFilter { at: 0 });
        assert_eq!(
            err("{a|upper}"),
            UnknownFilter {
                name: "upper".into()
            }
        );
        assert!(matches!(err("{a|window}"), FilterArgument { .. }));
        assert!(matches!(err("{a|sha256:x}"), FilterArgument { .. }));
        assert!(matches!(
            err("{a|window:5}"),
            Duration(DurationError::MissingUnit { .. })
        ));
        assert!(matches!(
            err("{a|window:0s}"),
            Duration(DurationError::Zero { .. })
        ));
        assert_eq!(err(""), Empty);
        let msg = err("{a|upper}").to_string();
        assert!(msg.contains("unknown filter \"upper\""), "{msg}");
    }

    #[test]
    fn render_errors_name_the_field() {
        let e = json!({"a": null, "o": {"p": 1}, "arr": [1], "s": "x", "t": "not a time"});
        let err = |t: &str| render(t, &e).unwrap_err();
        assert_eq!(
            err("{missing}"),
            RenderError::MissingField {
                field: "missing".into()
            }
        );
        assert_eq!(
            err("{o.q}"),
            RenderError::MissingField {
                field: "o.q".into()
            }
        );
        assert_eq!(
            err("{s.deeper}"),
            RenderError::MissingField {
                field: "s.deeper".into()
            }
        );
        assert_eq!(
            err("{arr.5}"),
            RenderError::MissingField {
                field: "arr.5".into()
            }
        );
        assert_eq!(err("{a}"), RenderError::Null { field: "a".into() });
        assert_eq!(
            err("{o}"),
            RenderError::NotScalar {
                field: "o".into(),
                found: "an object"
            }
        );
        assert_eq!(
            err("{arr}"),
            RenderError::NotScalar {
                field: "arr".into(),
                found: "an array"
            }
        );
        assert!(
            matches!(err("{t|window:5m}"), RenderError::Timestamp { field, .. } if field == "t")
        );
        assert!(err("{missing}").to_string().contains("`missing`"));
        assert!(matches!(
            KeyTemplate::parse("{a}").unwrap().render(&json!([1]), 0),
            Err(RenderError::NotAnObject { .. })
        ));
    }
}
