//! Errors of the proxy crate. Outcomes a caller sees on the wire (409, 422, …) are responses,
//! not errors; these are the failures to start or to read what was stored.

/// The configuration cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A field is malformed or out of range.
    #[error("invalid proxy configuration: {0}")]
    Invalid(String),
    /// The upstream URL is unusable.
    #[error("invalid upstream {url:?}: {reason}")]
    Upstream {
        /// The URL as given.
        url: String,
        /// Why it was refused.
        reason: String,
    },
    /// TLS material (CA file, key) could not be loaded.
    #[error("TLS setup failed: {0}")]
    Tls(String),
}

/// A stored response could not be turned back into a response.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoredError {
    /// The stored JSON is not a response this crate wrote.
    #[error("stored response is malformed: {0}")]
    Malformed(String),
    /// The response is encrypted and no key, or another key, is configured.
    #[error("stored response cannot be decrypted: {0}")]
    Sealed(String),
}

/// The proxy server failed to start or stopped on an I/O error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The listen address cannot be bound: named, so a busy port says which one.
    #[error("{}", bind_message(addr, error))]
    Bind {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// Why binding failed (in the message already, so not also the error's source).
        error: std::io::Error,
    },
    /// Accepting or serving failed.
    #[error("proxy I/O: {0}")]
    Io(std::io::Error),
}

fn bind_message(addr: &std::net::SocketAddr, e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::AddrInUse => format!("{addr} is in use by another process"),
        std::io::ErrorKind::AddrNotAvailable => {
            format!("cannot listen on {addr}: no interface of this machine has that address")
        }
        _ => format!("cannot listen on {addr}: {e}"),
    }
}

// By hand rather than `#[from]`: the message already holds the cause, so it is not also the
// error's source (a report walking the sources would say it twice).
impl From<std::io::Error> for ServeError {
    fn from(e: std::io::Error) -> Self {
        ServeError::Io(e)
    }
}
