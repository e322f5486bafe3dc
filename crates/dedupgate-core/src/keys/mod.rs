//! Keys: where a dedup key comes from.
//!
//! - [`KeyTemplate`] (template.rs): `{asset}_{signal}_{ts|window:5m}` parsed once, rendered per
//!   event, with [`TemplateError`] for a bad template and [`RenderError`] (naming the field) for
//!   an event it cannot render.
//! - Deterministic ids (id.rs): [`record_id`] is the hex SHA-256 of [`canonical_key`], the
//!   canonical JSON of the key fields exactly as Python's `json.dumps(obj, sort_keys=True)`
//!   writes it; [`RawObject`] computes the same from a JSON line without building the record.
//! - Time (time.rs): [`parse_duration_ms`] for every duration flag, and the RFC 3339 and epoch
//!   conversions the `window` filter uses.

mod id;
mod template;
mod time;

pub use id::{
    canonical_key, id_bytes, id_hex, record_id, write_canonical_key, write_python_float,
    write_python_json, write_python_json_raw, write_python_number, write_python_str, FieldValue,
    IdError, KeyFields, RawObject,
};
pub use template::{KeyTemplate, RenderError, TemplateError};
pub use time::{
    epoch_int_to_ms, epoch_to_ms, format_duration_ms, format_rfc3339_ms, parse_duration_ms,
    parse_rfc3339_ms, parse_timestamp_ms, DurationError, TimestampError, DURATION_MS_MAX,
    EPOCH_SECONDS_BELOW,
};
