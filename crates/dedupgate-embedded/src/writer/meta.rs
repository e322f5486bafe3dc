//! The engine's meta keys: the format version (checked, or migrated, at open), the clock floor
//! every commit raises, and the number of entries held.

use crate::engine::{Engine, EngineError, Txn};
use crate::keyset;

/// Meta key of the latest instant any commit decided on (unix ms).
pub(crate) const META_CLOCK_MS: &str = "clock_high_water_ms";
/// Meta key of the number of entries stored (kept by the writer: engines count slowly).
pub(crate) const META_HELD: &str = "entries_held";
/// Meta key of the store's format version.
pub(crate) const META_FORMAT: &str = "format_version";

/// Persists `now_ms` as the latest instant decided on (or swept at) unless a later one is, so a
/// restart's clock never starts before it.
pub(crate) fn raise_clock_floor(txn: &mut dyn Txn, now_ms: u64) -> Result<(), EngineError> {
    if txn.meta_get(META_CLOCK_MS)?.unwrap_or(0) < now_ms {
        txn.meta_put(META_CLOCK_MS, now_ms)?;
    }
    Ok(())
}

/// Why a store's format cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FormatProblem {
    /// Written by a build with another format.
    Unknown(u64),
    /// Entries but no version: not a store this build wrote.
    Missing,
    /// An older format holding something its migration cannot read.
    Unmigratable(String),
}

impl std::fmt::Display for FormatProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FormatProblem::Unknown(v) => write!(
                f,
                "the store has format version {v}; this build reads version {} (and migrates {:?})",
                crate::FORMAT_VERSION,
                crate::FORMATS_MIGRATED
            ),
            FormatProblem::Unmigratable(why) => {
                write!(f, "the store's format cannot be migrated: {why}")
            }
            FormatProblem::Missing => {
                f.write_str("entries exist but the store has no format version")
            }
        }
    }
}

/// Checks (or, on a new store, writes) the format version, migrating each of
/// [`crate::FORMATS_MIGRATED`] in the same transaction as the new version: 2 had no key set (the
/// engine already opened its partition: only the version changes), 3 kept one entry per key
/// (rewritten as chunks, [`keyset::migrate_members`]). Returns the persisted clock floor.
pub(crate) fn check_format(
    engine: &mut dyn Engine,
) -> Result<Result<u64, FormatProblem>, EngineError> {
    let mut outcome = Ok(0);
    engine.write(&mut |txn: &mut dyn Txn| match txn.meta_get(META_FORMAT)? {
        None if !txn.is_empty()? => {
            outcome = Err(FormatProblem::Missing);
            Ok(false)
        }
        None => {
            txn.meta_put(META_FORMAT, crate::FORMAT_VERSION)?;
            outcome = Ok(0);
            Ok(true)
        }
        Some(v) if v == crate::FORMAT_VERSION => {
            outcome = Ok(txn.meta_get(META_CLOCK_MS)?.unwrap_or(0));
            Ok(false)
        }
        Some(v) if crate::FORMATS_MIGRATED.contains(&v) => {
            if v == 3 {
                if let Err(e) = keyset::migrate_members(txn)? {
                    outcome = Err(FormatProblem::Unmigratable(e.0));
                    return Ok(false);
                }
            }
            txn.meta_put(META_FORMAT, crate::FORMAT_VERSION)?;
            outcome = Ok(txn.meta_get(META_CLOCK_MS)?.unwrap_or(0));
            Ok(true)
        }
        Some(v) => {
            outcome = Err(FormatProblem::Unknown(v));
            Ok(false)
        }
    })?;
    Ok(outcome)
}
