//! Durations with units (`500ms`, `30s`, `5m`, `24h`, `7d`) and RFC 3339 timestamps, without a
//! date library: the key templates and the command line need only these few conversions, and
//! doing them here keeps them exact and dependency-free.

/// Most milliseconds a duration may hold: ten years (the core's longest ttl), so every sum with
/// a timestamp stays far inside `i64`.
pub const DURATION_MS_MAX: u64 = crate::op::DURATION_MS_MAX;

/// Epoch numbers below this are seconds, from it on milliseconds (see [`epoch_to_ms`]).
pub const EPOCH_SECONDS_BELOW: i64 = 100_000_000_000;

/// First and last instant a key can name: years 0000 to 9999, so RFC 3339 can write them.
const MS_MIN: i64 = -62_167_219_200_000; // 0000-01-01T00:00:00Z
const MS_MAX: i64 = 253_402_300_799_999; // 9999-12-31T23:59:59.999Z

/// Why a duration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DurationError {
    /// Nothing was given.
    #[error("empty duration: give a number with a unit, e.g. 500ms, 30s, 5m, 24h, 7d")]
    Empty,
    /// A number without a unit: `30` could be seconds or milliseconds, so it is refused.
    #[error(
        "duration {input:?} has no unit: write e.g. {input}s or {input}ms (units: ms, s, m, h, d)"
    )]
    MissingUnit {
        /// What was given.
        input: String,
    },
    /// A unit other than ms, s, m, h, d.
    #[error("duration {input:?}: unknown unit {unit:?} (units: ms, s, m, h, d)")]
    UnknownUnit {
        /// What was given.
        input: String,
        /// The unit found.
        unit: String,
    },
    /// Not of the form NUMBER UNIT [NUMBER UNIT …].
    #[error("duration {input:?} is malformed: expected e.g. 500ms, 30s, 5m, 24h, 7d or 1h30m")]
    Malformed {
        /// What was given.
        input: String,
    },
    /// Zero length: a window or ttl of nothing means nothing.
    #[error("duration {input:?} is zero: it must be at least 1ms")]
    Zero {
        /// What was given.
        input: String,
    },
    /// Longer than ten years.
    #[error("duration {input:?} is longer than the maximum of {DURATION_MS_MAX} ms (ten years)")]
    TooLong {
        /// What was given.
        input: String,
    },
}

/// Parses a duration with units into milliseconds: `500ms`, `30s`, `5m`, `24h`, `7d`, and sums
/// of them such as `1h30m`. A bare number is refused (its unit would be a guess).
///
/// ```
/// use dedupgate_core::keys::parse_duration_ms;
/// assert_eq!(parse_duration_ms("5m").unwrap(), 300_000);
/// assert_eq!(parse_duration_ms("1h30m").unwrap(), 5_400_000);
/// assert!(parse_duration_ms("30").is_err());
/// ```
pub fn parse_duration_ms(input: &str) -> Result<u64, DurationError> {
    let s = input.trim();
    if s.is_empty() {
        return Err(DurationError::Empty);
    }
    let owned = || s.to_owned();
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut total_ms: u64 = 0;
    while i < bytes.len() {
        let digits_start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if i == digits_start {
            return Err(DurationError::Malformed { input: owned() });
        }
        let number: u64 = s[digits_start..i]
            .parse()
            .map_err(|_| DurationError::TooLong { input: owned() })?;
        let unit_start = i;
        while i < bytes.len() && bytes[i].is_ascii_alphabetic() {
            i += 1;
        }
        let unit = &s[unit_start..i];
        let unit_ms: u64 = match unit {
            "" if i == bytes.len() => return Err(DurationError::MissingUnit { input: owned() }),
            "" => return Err(DurationError::Malformed { input: owned() }),
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            other => {
                return Err(DurationError::UnknownUnit {
                    input: owned(),
                    unit: other.to_owned(),
                })
            }
        };
        total_ms = number
            .checked_mul(unit_ms)
            .and_then(|ms| total_ms.checked_add(ms))
            .filter(|&ms| ms <= DURATION_MS_MAX)
            .ok_or_else(|| DurationError::TooLong { input: owned() })?;
    }
    if total_ms == 0 {
        return Err(DurationError::Zero { input: owned() });
    }
    Ok(total_ms)
}

/// Writes milliseconds back with units, largest first: `90000` gives `1m30s`. Inverse of
/// [`parse_duration_ms`] for every value it accepts.
pub fn format_duration_ms(ms: u64) -> String {
    if ms == 0 {
        return "0ms".to_owned();
    }
    let mut rest = ms;
    let mut out = String::new();
    for (unit, unit_ms) in [
        ("d", 86_400_000u64),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
        ("ms", 1),
    ] {
        if rest >= unit_ms {
            out.push_str(&(rest / unit_ms).to_string());
            out.push_str(unit);
            rest %= unit_ms;
        }
    }
    out
}

/// Why a timestamp was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TimestampError {
    /// Not RFC 3339 and not an epoch number.
    #[error("{input:?} is not a timestamp: expected RFC 3339 (2026-03-01T14:30:00Z) or epoch seconds/milliseconds ({reason})")]
    Malformed {
        /// What was given.
        input: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Outside years 0000..=9999.
    #[error("{input:?} is outside the years 0000 to 9999")]
    OutOfRange {
        /// What was given.
        input: String,
    },
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's `days_from_civil`).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day count since 1970-01-01 (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_in_month(year: i64, month: u32) -> u32 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        _ if (year % 4 == 0 && year % 100 != 0) || year % 400 == 0 => 29,
        _ => 28,
    }
}

/// Writes an instant as RFC 3339 UTC with `Z`: `2026-03-01T14:30:00Z`, or with milliseconds
/// (`…:00.500Z`) when `with_ms`. `None` outside the years 0000..=9999.
pub fn format_rfc3339_ms(ms: i64, with_ms: bool) -> Option<String> {
    if !(MS_MIN..=MS_MAX).contains(&ms) {
        return None;
    }
    let days = ms.div_euclid(86_400_000);
    let ms_of_day = ms.rem_euclid(86_400_000);
    let (year, month, day) = civil_from_days(days);
    let (h, m, s, milli) = (
        ms_of_day / 3_600_000,
        ms_of_day / 60_000 % 60,
        ms_of_day / 1000 % 60,
        ms_of_day % 1000,
    );
    Some(if with_ms {
        format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{milli:03}Z")
    } else {
        format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}Z")
    })
}

/// Parses an RFC 3339 timestamp to unix milliseconds (fractions beyond milliseconds are
/// dropped, which floors). Accepts `T`, `t` or a space between date and time, `Z`/`z` or a
/// `±HH:MM` offset, and a bare full-date (`2026-03-01`, taken as midnight UTC). A date-time
/// without an offset is refused: its instant would be a guess.
pub fn parse_rfc3339_ms(input: &str) -> Result<i64, TimestampError> {
    let bad = |reason| TimestampError::Malformed {
        input: input.to_owned(),
        reason,
    };
    let b = input.trim().as_bytes();
    let num = |range: std::ops::Range<usize>| -> Option<u32> {
        let part = b.get(range)?;
        if part.iter().all(u8::is_ascii_digit) {
            Some(part.iter().fold(0, |n, d| n * 10 + u32::from(d - b'0')))
        } else {
            None
        }
    };
    let (year, month, day) = match (num(0..4), b.get(4), num(5..7), b.get(7), num(8..10)) {
        (Some(y), Some(b'-'), Some(m), Some(b'-'), Some(d)) => (i64::from(y), m, d),
        _ => return Err(bad("the date must be YYYY-MM-DD")),
    };
    if !(1..=12).contains(&month) || day == 0 || day > days_in_month(year, month) {
        return Err(bad("no such date"));
    }
    let date_ms = days_from_civil(year, month, day) * 86_400_000;
    if b.len() == 10 {
        return Ok(date_ms);
    }
    if !matches!(b.get(10), Some(b'T' | b't' | b' ')) {
        return Err(bad("expected T between the date and the time"));
    }
    let (h, m, s) = match (num(11..13), b.get(13), num(14..16), b.get(16), num(17..19)) {
        (Some(h), Some(b':'), Some(m), Some(b':'), Some(s)) => (h, m, s),
        _ => return Err(bad("the time must be HH:MM:SS")),
    };
    // A leap second (:60) is accepted and lands on the next second, as most libraries do.
    if h > 23 || m > 59 || s > 60 {
        return Err(bad("no such time of day"));
    }
    let mut i = 19;
    let mut frac_ms: i64 = 0;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            if i - start < 3 {
                frac_ms = frac_ms * 10 + i64::from(b[i] - b'0');
            }
            i += 1;
        }
        if i == start {
            return Err(bad("a fraction needs digits after the dot"));
        }
        for _ in (i - start)..3 {
            frac_ms *= 10;
        }
    }
    let offset_ms: i64 = match b.get(i) {
        Some(b'Z' | b'z') if i + 1 == b.len() => 0,
        Some(&sign @ (b'+' | b'-')) if i + 6 == b.len() && b[i + 3] == b':' => {
            match (num(i + 1..i + 3), num(i + 4..i + 6)) {
                (Some(oh), Some(om)) if oh <= 23 && om <= 59 => {
                    let v = i64::from(oh * 3_600_000 + om * 60_000);
                    if sign == b'+' {
                        v
                    } else {
                        -v
                    }
                }
                _ => return Err(bad("the offset must be Z or ±HH:MM")),
            }
        }
        None => return Err(bad("no UTC offset: add Z or ±HH:MM")),
        _ => return Err(bad("the offset must be Z or ±HH:MM")),
    };
    let ms = date_ms + i64::from(h * 3_600_000 + m * 60_000 + s * 1000) + frac_ms - offset_ms;
    if !(MS_MIN..=MS_MAX).contains(&ms) {
        return Err(TimestampError::OutOfRange {
            input: input.to_owned(),
        });
    }
    Ok(ms)
}

/// Unix milliseconds of an epoch number given in seconds or milliseconds.
///
/// How seconds are told from milliseconds: a magnitude below 100,000,000,000
/// ([`EPOCH_SECONDS_BELOW`]) is seconds, anything larger is milliseconds. In seconds that bound
/// is the year 5138; in milliseconds it is 1973-03-03, so every timestamp a live system writes
/// today is read right either way. Fractional seconds (`1764000000.25`) are kept to the
/// millisecond, flooring.
pub fn epoch_to_ms(value: f64, text: &str) -> Result<i64, TimestampError> {
    if !value.is_finite() {
        return Err(TimestampError::Malformed {
            input: text.to_owned(),
            reason: "not a finite number",
        });
    }
    let ms = if value.abs() < EPOCH_SECONDS_BELOW as f64 {
        (value * 1000.0).floor()
    } else {
        value.floor()
    };
    if !(MS_MIN as f64..=MS_MAX as f64).contains(&ms) {
        return Err(TimestampError::OutOfRange {
            input: text.to_owned(),
        });
    }
    Ok(ms as i64)
}

/// Unix milliseconds of an epoch integer given in seconds or milliseconds, exactly (see
/// [`epoch_to_ms`] for the rule).
pub fn epoch_int_to_ms(value: i128, text: &str) -> Result<i64, TimestampError> {
    let ms = if value.abs() < i128::from(EPOCH_SECONDS_BELOW) {
        value * 1000
    } else {
        value
    };
    if !(i128::from(MS_MIN)..=i128::from(MS_MAX)).contains(&ms) {
        return Err(TimestampError::OutOfRange {
            input: text.to_owned(),
        });
    }
    Ok(ms as i64)
}

/// Reads a timestamp given as text: an epoch number (seconds or milliseconds, see
/// [`epoch_to_ms`]) or RFC 3339.
pub fn parse_timestamp_ms(text: &str) -> Result<i64, TimestampError> {
    let t = text.trim();
    let looks_numeric = !t.is_empty()
        && t.bytes()
            .all(|c| c.is_ascii_digit() || matches!(c, b'-' | b'+' | b'.' | b'e' | b'E'))
        && t.bytes().any(|c| c.is_ascii_digit())
        && !(t.len() >= 10 && t.as_bytes()[4] == b'-');
    if looks_numeric {
        if t.bytes().all(|c| c.is_ascii_digit() || c == b'-') {
            if let Ok(v) = t.parse::<i128>() {
                return epoch_int_to_ms(v, text);
            }
        }
        return match t.parse::<f64>() {
            Ok(v) => epoch_to_ms(v, text),
            Err(_) => Err(TimestampError::Malformed {
                input: text.to_owned(),
                reason: "not a number",
            }),
        };
    }
    parse_rfc3339_ms(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration_ms("500ms"), Ok(500));
        assert_eq!(parse_duration_ms("30s"), Ok(30_000));
        assert_eq!(parse_duration_ms("5m"), Ok(300_000));
        assert_eq!(parse_duration_ms("24h"), Ok(86_400_000));
        assert_eq!(parse_duration_ms(" 7d "), Ok(604_800_000));
        assert_eq!(parse_duration_ms("1h30m"), Ok(5_400_000));
        assert!(matches!(
            parse_duration_ms("30"),
            Err(DurationError::MissingUnit { .. })
        ));
        assert!(matches!(
            parse_duration_ms("5y"),
            Err(DurationError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_duration_ms("0s"),
            Err(DurationError::Zero { .. })
        ));
        assert!(matches!(parse_duration_ms(""), Err(DurationError::Empty)));
        assert!(matches!(
            parse_duration_ms("m5"),
            Err(DurationError::Malformed { .. })
        ));
        assert!(matches!(
            parse_duration_ms("-5m"),
            Err(DurationError::Malformed { .. })
        ));
        assert!(matches!(
            parse_duration_ms("1.5h"),
            Err(DurationError::Malformed { .. })
        ));
        assert!(matches!(
            parse_duration_ms("99999999999999999999999d"),
            Err(DurationError::TooLong { .. })
        ));
        assert!(matches!(
            parse_duration_ms("3651d"),
            Err(DurationError::TooLong { .. })
        ));
        for ms in [1, 999, 1000, 90_000, 86_400_001, 5_400_000] {
            assert_eq!(parse_duration_ms(&format_duration_ms(ms)), Ok(ms));
        }
        assert_eq!(format_duration_ms(90_000), "1m30s");
    }

    #[test]
    fn rfc3339_round_trips_across_the_calendar() {
        // Every day from 1600 to 2400 round-trips through the civil conversions.
        for days in days_from_civil(1600, 1, 1)..days_from_civil(2400, 12, 31) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
            assert!(d >= 1 && d <= days_in_month(y, m));
        }
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00Z"), Ok(0));
        assert_eq!(
            parse_rfc3339_ms("2026-03-01T14:32:10.123456+01:00"),
            Ok(1_772_371_930_123)
        );
        assert_eq!(
            format_rfc3339_ms(1_772_375_530_123, true).unwrap(),
            "2026-03-01T14:32:10.123Z"
        );
        assert_eq!(parse_rfc3339_ms("2024-02-29"), Ok(1_709_164_800_000));
        assert!(parse_rfc3339_ms("2023-02-29").is_err());
        assert!(parse_rfc3339_ms("2026-03-01T14:30:00").is_err());
        assert!(parse_rfc3339_ms("2026-03-01T24:00:00Z").is_err());
        assert!(parse_rfc3339_ms("2026-3-01T14:30:00Z").is_err());
        assert!(parse_rfc3339_ms("2026-03-01T14:30:00.Z").is_err());
        assert!(parse_rfc3339_ms("2026-03-01T14:30:00Zjunk").is_err());
        assert_eq!(
            format_rfc3339_ms(-1, true).unwrap(),
            "1969-12-31T23:59:59.999Z"
        );
        assert_eq!(
            format_rfc3339_ms(MS_MAX, false).unwrap(),
            "9999-12-31T23:59:59Z"
        );
        assert!(format_rfc3339_ms(MS_MAX + 1, false).is_none());
        assert_eq!(
            format_rfc3339_ms(MS_MIN, false).unwrap(),
            "0000-01-01T00:00:00Z"
        );
    }

    #[test]
    fn epoch_seconds_and_milliseconds() {
        assert_eq!(parse_timestamp_ms("1772375400"), Ok(1_772_375_400_000));
        assert_eq!(parse_timestamp_ms("1772375400000"), Ok(1_772_375_400_000));
        assert_eq!(parse_timestamp_ms("1772375400.25"), Ok(1_772_375_400_250));
        assert_eq!(parse_timestamp_ms("-1.5"), Ok(-1500));
        assert_eq!(parse_timestamp_ms("99999999999"), Ok(99_999_999_999_000));
        assert_eq!(parse_timestamp_ms("100000000000"), Ok(100_000_000_000));
        assert!(parse_timestamp_ms("1e300").is_err());
        assert!(parse_timestamp_ms("12-34").is_err());
        assert!(parse_timestamp_ms("yesterday").is_err());
    }
}
