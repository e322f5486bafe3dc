//! What the gate remembers: validated identities, the public [`Record`] and the stored [`Entry`].

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::InvalidInput;

/// Longest namespace, in bytes (API.md).
pub const NAMESPACE_BYTES_MAX: usize = 128;
/// Longest key, in bytes (API.md).
pub const KEY_BYTES_MAX: usize = 1024;
/// Longest fingerprint or owner, in bytes. Not in API.md's v1 text; bounded so a record stays small.
pub const TAG_BYTES_MAX: usize = 256;

/// Who owns a key space: 1..=128 bytes of `[A-Za-z0-9._:-]`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Namespace(String);

impl Namespace {
    /// Validates a namespace.
    pub fn new(value: impl Into<String>) -> Result<Self, InvalidInput> {
        let value = value.into();
        if value.is_empty() || value.len() > NAMESPACE_BYTES_MAX {
            return Err(InvalidInput::new(
                "namespace",
                format!(
                    "must be 1..={NAMESPACE_BYTES_MAX} bytes, got {}",
                    value.len()
                ),
            ));
        }
        if let Some(bad) = value
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')))
        {
            return Err(InvalidInput::new(
                "namespace",
                format!("may hold only [A-Za-z0-9._:-], found {bad:?}"),
            ));
        }
        Ok(Self(value))
    }

    /// The namespace as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for Namespace {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Namespace::new(String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// The dedup key: any UTF-8 string of 1..=1024 bytes (NUL included).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Key(String);

impl Key {
    /// Validates a key.
    pub fn new(value: impl Into<String>) -> Result<Self, InvalidInput> {
        let value = value.into();
        if value.is_empty() || value.len() > KEY_BYTES_MAX {
            return Err(InvalidInput::new(
                "key",
                format!("must be 1..={KEY_BYTES_MAX} bytes, got {}", value.len()),
            ));
        }
        Ok(Self(value))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Key::new(String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

macro_rules! debug_as_str {
    ($($t:ty),*) => {$(
        impl fmt::Debug for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    )*};
}
debug_as_str!(Namespace, Key);

/// Identity of a record: the pair (namespace, key).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RecordId {
    /// Who owns the key space.
    pub namespace: Namespace,
    /// The dedup key.
    pub key: Key,
}

impl RecordId {
    /// Validates both parts.
    pub fn new(namespace: impl Into<String>, key: impl Into<String>) -> Result<Self, InvalidInput> {
        Ok(Self {
            namespace: Namespace::new(namespace)?,
            key: Key::new(key)?,
        })
    }
}

/// Validates an optional fingerprint or owner tag.
pub(crate) fn check_tag(field: &'static str, value: &Option<String>) -> Result<(), InvalidInput> {
    match value {
        Some(v) if v.is_empty() || v.len() > TAG_BYTES_MAX => Err(InvalidInput::new(
            field,
            format!(
                "must be 1..={TAG_BYTES_MAX} bytes when given, got {}",
                v.len()
            ),
        )),
        _ => Ok(()),
    }
}

/// The claimer's secret. Only the answer to the claim that created it ever carries it.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Token(String);

impl Token {
    /// Wraps a token received from a client.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// A fresh token: 128 random bits as 32 hex digits, from the thread's CSPRNG (ChaCha,
    /// seeded and periodically reseeded from the operating system), without a system call per
    /// token: a `getrandom` per claim was ~6% of a store's CPU on a batch. The digits are
    /// written into a buffer (`hex::encode` collects them char by char).
    pub fn generate() -> Self {
        let bytes: [u8; 16] = rand::Rng::gen(&mut rand::thread_rng());
        let mut digits = [0u8; 32];
        hex::encode_to_slice(bytes, &mut digits).expect("32 digits for 16 bytes");
        Self(std::str::from_utf8(&digits).expect("hex digits").to_owned())
    }

    /// The token as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Token {
    // Tokens are secrets: never print them whole, not even in debug logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({}…)", self.0.get(..4).unwrap_or(""))
    }
}

/// Public state of a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    /// Claimed and held under a lease.
    InProgress,
    /// Done; duplicates get its stored result.
    Completed,
}

/// What the gate remembers about a key, as every answer shows it. It never holds the token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Who owns the key space.
    pub namespace: Namespace,
    /// The dedup key.
    pub key: Key,
    /// in_progress or completed.
    pub state: State,
    /// Fencing token of the claim that made this record.
    pub fence: u64,
    /// Client-supplied payload hash, if any.
    pub fingerprint: Option<String>,
    /// Client-chosen id of the claimer, if any.
    pub owner: Option<String>,
    /// When the record was made (unix ms, store clock).
    pub created_at_ms: u64,
    /// The record is forgotten at this instant.
    pub expires_at_ms: u64,
    /// in_progress only: when another worker may take the key over.
    pub lease_expires_at_ms: Option<u64>,
    /// completed only.
    pub completed_at_ms: Option<u64>,
    /// completed only: the stored result.
    pub result: Option<serde_json::Value>,
}

/// Internal state of a stored entry: the public two plus a tombstone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryState {
    /// Claimed and held under a lease.
    InProgress,
    /// Done.
    Completed,
    /// Released: the key is free, but the entry keeps its fence so the next claim's fence is higher.
    Released,
}

/// What a store keeps under one [`RecordId`]: a flat row that every store can hold as it is
/// (a struct in memory, a row in SQL, a hash in Redis). Unlike [`Record`] it carries the token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// in_progress, completed, or released (a fence-keeping tombstone).
    pub state: EntryState,
    /// Fence of the claim that made this entry.
    pub fence: u64,
    /// Holder's token (in_progress), or the token that completed it (so a retried complete is answered).
    pub token: Option<Token>,
    /// Client-supplied payload hash.
    pub fingerprint: Option<String>,
    /// Client-chosen claimer id.
    pub owner: Option<String>,
    /// Unix ms, store clock.
    pub created_at_ms: u64,
    /// Unix ms; at or after this instant the entry is absent.
    pub expires_at_ms: u64,
    /// in_progress only.
    pub lease_expires_at_ms: Option<u64>,
    /// completed only.
    pub completed_at_ms: Option<u64>,
    /// completed only.
    pub result: Option<serde_json::Value>,
    /// in_progress only: the ttl its claim asked for. A complete that names no ttl keeps the
    /// record until `created_at_ms + ttl_ms` (the claim's expiry may be later, held up by the
    /// lease). `None` on entries stored before claims kept it: their expiry then stands.
    pub ttl_ms: Option<u64>,
}

impl Entry {
    /// True while the entry still counts at `now_ms` (it is forgotten at `expires_at_ms`).
    pub fn is_live(&self, now_ms: u64) -> bool {
        now_ms < self.expires_at_ms
    }

    /// True once an in-progress entry's lease has passed at `now_ms` (anyone may take it over).
    pub fn lease_passed(&self, now_ms: u64) -> bool {
        self.lease_expires_at_ms.is_some_and(|l| now_ms >= l)
    }

    /// True when a claim of the key at `now_ms` by anyone but its holder is a duplicate: the
    /// entry is live, and completed or in progress under a lease that has not passed.
    pub fn holds(&self, now_ms: u64) -> bool {
        self.is_live(now_ms)
            && match self.state {
                EntryState::Completed => true,
                EntryState::InProgress => !self.lease_passed(now_ms),
                EntryState::Released => false,
            }
    }

    /// The public view, or `None` for a tombstone or an expired entry.
    pub fn to_record(&self, id: &RecordId, now_ms: u64) -> Option<Record> {
        let state = match self.state {
            _ if !self.is_live(now_ms) => return None,
            EntryState::InProgress => State::InProgress,
            EntryState::Completed => State::Completed,
            EntryState::Released => return None,
        };
        Some(Record {
            namespace: id.namespace.clone(),
            key: id.key.clone(),
            state,
            fence: self.fence,
            fingerprint: self.fingerprint.clone(),
            owner: self.owner.clone(),
            created_at_ms: self.created_at_ms,
            expires_at_ms: self.expires_at_ms,
            lease_expires_at_ms: self.lease_expires_at_ms,
            completed_at_ms: self.completed_at_ms,
            result: self.result.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Token;

    #[test]
    fn a_generated_token_is_32_lowercase_hex_digits_and_never_repeats() {
        let tokens: std::collections::HashSet<String> = (0..1000)
            .map(|_| Token::generate().as_str().to_owned())
            .collect();
        assert_eq!(tokens.len(), 1000);
        for t in &tokens {
            assert_eq!(t.len(), 32, "{t}");
            assert!(
                t.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
                "{t}"
            );
        }
    }
}
