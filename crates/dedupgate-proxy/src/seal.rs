//! Encryption at rest of stored responses: AES-256-GCM with a random 96-bit nonce per record and
//! the record's identity as associated data, so a sealed response cannot be moved to another key.

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;

use crate::error::{ConfigError, StoredError};

/// Name of the algorithm as written into sealed records.
pub const ALGORITHM: &str = "A256GCM";
const NONCE_BYTES: usize = 12;

/// Seals and opens stored responses with one 256-bit key.
#[derive(Clone)]
pub struct Sealer {
    cipher: Aes256Gcm,
}

impl std::fmt::Debug for Sealer {
    // The key is a secret: never print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sealer(A256GCM)")
    }
}

impl Sealer {
    /// A sealer over a 32-byte key.
    pub fn new(key: &[u8; 32]) -> Self {
        Self {
            cipher: Aes256Gcm::new(key.into()),
        }
    }

    /// Parses a key written as 64 hex digits or as base64 of 32 bytes (surrounding whitespace,
    /// such as a file's trailing newline, is ignored).
    pub fn from_text(text: &str) -> Result<Self, ConfigError> {
        let t = text.trim();
        let bytes = if t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()) {
            hex::decode(t).map_err(|e| ConfigError::Invalid(format!("encryption key: {e}")))?
        } else {
            B64.decode(t).map_err(|_| {
                ConfigError::Invalid(
                    "encryption key must be 64 hex digits or base64 of 32 bytes".into(),
                )
            })?
        };
        let key: [u8; 32] = bytes.try_into().map_err(|b: Vec<u8>| {
            ConfigError::Invalid(format!("encryption key must be 32 bytes, got {}", b.len()))
        })?;
        Ok(Self::new(&key))
    }

    /// Encrypts `plain`, binding it to `aad`. Returns (nonce, ciphertext) as base64.
    pub fn seal(&self, plain: &[u8], aad: &[u8]) -> (String, String) {
        let mut nonce = [0u8; NONCE_BYTES];
        getrandom::getrandom(&mut nonce).expect("the operating system's random source failed");
        let ct = self
            .cipher
            .encrypt(Nonce::from_slice(&nonce), Payload { msg: plain, aad })
            .expect("AES-GCM encryption cannot fail for in-memory buffers under 64 GiB");
        (B64.encode(nonce), B64.encode(ct))
    }

    /// Decrypts what [`Sealer::seal`] made for the same `aad`.
    pub fn open(&self, nonce_b64: &str, ct_b64: &str, aad: &[u8]) -> Result<Vec<u8>, StoredError> {
        let nonce = B64
            .decode(nonce_b64)
            .map_err(|e| StoredError::Malformed(format!("nonce: {e}")))?;
        if nonce.len() != NONCE_BYTES {
            return Err(StoredError::Malformed("nonce must be 12 bytes".into()));
        }
        let ct = B64
            .decode(ct_b64)
            .map_err(|e| StoredError::Malformed(format!("ciphertext: {e}")))?;
        self.cipher
            .decrypt(Nonce::from_slice(&nonce), Payload { msg: &ct, aad })
            .map_err(|_| StoredError::Sealed("wrong key, or the record was altered".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_binding() {
        let s = Sealer::from_text(&"ab".repeat(32)).unwrap();
        let (n, c) = s.seal(b"hello", b"ns/key1");
        assert_eq!(s.open(&n, &c, b"ns/key1").unwrap(), b"hello");
        assert!(s.open(&n, &c, b"ns/key2").is_err());
        let other = Sealer::from_text(&"cd".repeat(32)).unwrap();
        assert!(other.open(&n, &c, b"ns/key1").is_err());
        assert!(Sealer::from_text("short").is_err());
        assert!(!c.contains("hello"));
    }
}
