//! Why a store directory could not be opened. Every variant names the path and what to do.

use std::io;
use std::path::PathBuf;

use dedupgate_core::StoreError;

/// A refused open. A failed open leaves the directory as it found it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The store directory does not exist and neither does its parent (only the last
    /// component is ever created).
    #[error("store directory {dir}: its parent directory does not exist; create it first")]
    ParentMissing {
        /// The directory asked for.
        dir: PathBuf,
    },
    /// The path exists but is not a directory.
    #[error("store path {dir} exists but is not a directory")]
    NotADirectory {
        /// The path asked for.
        dir: PathBuf,
    },
    /// Another process (or another store in this process) holds the directory's lock.
    #[error("store directory {dir} is in use by another process (lock held on {dir}/LOCK)")]
    Locked {
        /// The directory asked for.
        dir: PathBuf,
    },
    /// The directory or a file in it cannot be written.
    #[error("store path {path} is read-only or not writable: {cause}")]
    ReadOnly {
        /// The path that refused a write.
        path: PathBuf,
        /// The operating system's answer (in the message, so not also the error's source).
        cause: io::Error,
    },
    /// The file system has no space left.
    #[error("no space left for the store at {path}: {cause}")]
    Full {
        /// The path that refused a write.
        path: PathBuf,
        /// The operating system's answer (in the message, so not also the error's source).
        cause: io::Error,
    },
    /// The store's files hold data the engine cannot read.
    #[error("store file {path} is corrupt or not a dedupgate store: {detail}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What the engine said.
        detail: String,
    },
    /// The store was written with a format this build does not read.
    #[error(
        "store {path} has format version {found}; this build reads version {supported} and \
         migrates versions {migrated:?}",
        migrated = crate::FORMATS_MIGRATED
    )]
    UnknownFormat {
        /// The file.
        path: PathBuf,
        /// The version on disk.
        found: u64,
        /// The version this build reads.
        supported: u64,
    },
    /// The options are out of range.
    #[error("invalid embedded store options: {0}")]
    Options(String),
    /// Any other I/O failure.
    #[error("store path {path}: {cause}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The operating system's answer (in the message, so not also the error's source).
        cause: io::Error,
    },
    /// Any other engine failure.
    #[error("store file {path}: {detail}")]
    Engine {
        /// The file.
        path: PathBuf,
        /// What the engine said.
        detail: String,
    },
}

impl OpenError {
    /// Classifies an I/O error met while touching `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, cause: io::Error) -> Self {
        let path = path.into();
        const ENOSPC: i32 = 28;
        const EROFS: i32 = 30;
        const EDQUOT: i32 = 122;
        const EACCES: i32 = 13;
        const EPERM: i32 = 1;
        match cause.raw_os_error() {
            Some(ENOSPC | EDQUOT) => OpenError::Full { path, cause },
            Some(EROFS | EACCES | EPERM) => OpenError::ReadOnly { path, cause },
            _ => match cause.kind() {
                io::ErrorKind::PermissionDenied => OpenError::ReadOnly { path, cause },
                _ => OpenError::Io { path, cause },
            },
        }
    }
}

impl From<OpenError> for StoreError {
    fn from(e: OpenError) -> Self {
        match e {
            OpenError::Corrupt { .. } => StoreError::Corrupt(e.to_string()),
            OpenError::UnknownFormat { .. } | OpenError::Options(_) => {
                StoreError::Config(e.to_string())
            }
            other => StoreError::Unavailable(other.to_string()),
        }
    }
}
