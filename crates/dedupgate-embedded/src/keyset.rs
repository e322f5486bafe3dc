//! The key set: what `dedupgate dedup --ledger embedded:DIR` remembers between runs.
//!
//! A gate record carries a state, a token, a fence, an owner and a result, and a claim that is
//! later completed writes it twice. A pipeline's ledger needs none of that, only "was this key
//! let through within the ttl", for keys that arrive thousands per call, all recorded at one
//! instant with one ttl. So the set is kept in **chunks**: a call's recorded keys (16 bytes each
//! that name a key, the caller's SHA-256 prefix of it) go into one engine entry per
//! [`CHUNK_IDS_MAX`] keys, keyed by the instant they expire. The writer keeps every live id in
//! memory ([`Members`], loaded from the chunks by the first call that checks or records), so a
//! lookup is a hash probe and a new key costs 16 bytes of a chunk. Format 3 wrote one LSM entry
//! per key and looked each one up in the tree: a 1M-line ledger run took ~8x the run without
//! one, mostly in the memtable's skip list.
//!
//! The set lives beside the gate's records in the same directory, under the same lock, writer
//! and fsync rules: a [`KeySetCall`] that writes is one transaction and one fdatasync, answered
//! only after it. It is a separate set: a gate op never sees it (`dedupgate forget` on an
//! embedded store removes a key from it with [`KeySetCall::forget`] beside the gate op), and a
//! key-set member never answers a gate claim. The other way round, a call may name each checked key's gate record
//! ([`KeySetCall::gate_keys`]): a key the set does not hold is still known while that record is
//! live (completed, or in progress under a live lease), so a ledger kept as gate records (by a
//! build before the key set, or by runs through a server) keeps counting.
//!
//! Encoding (part of [`crate::FORMAT_VERSION`]): chunk key = expiry instant (u64 big-endian unix
//! ms) ++ a sequence number (u64 big-endian, from meta), so chunks sort by expiry and the sweeper
//! removes whole expired chunks from the front, no walk; chunk value = a version byte
//! ([`CHUNK_ENCODING_V1`]), the namespace's length (u16 big-endian) and bytes, then the ids.
//! Memory: about 40–60 bytes per live id (24 of data, the rest the hash tables' slack) while
//! the store has served a key-set call, up to [`crate::EmbeddedOptions::key_set_memory_ids`];
//! past it the ids of the chunks that expire first move to a per-key index on disk
//! ([`SetTable::Index`], format 3's member encoding), see [`Members::spill`].

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

use dedupgate_core::{Namespace, RecordId};

use crate::codec::{decode_entry, encode_id, DecodeError};
use crate::engine::{EngineError, SetTable, Txn};
use std::ops::Bound;

pub use dedupgate_core::ledger::{KeyId, KeySetCall};

/// Version of the chunk encoding written by this build.
pub const CHUNK_ENCODING_V1: u8 = 1;

/// Most ids in one chunk (64 KiB of ids): a call that records more writes several.
pub const CHUNK_IDS_MAX: usize = 4_096;

/// Most ids the writer holds in memory unless [`crate::EmbeddedOptions::key_set_memory_ids`]
/// says otherwise (2^23: about 0.5 GB at most).
pub const MEMORY_IDS_DEFAULT: usize = 1 << 23;

/// Meta key of the last chunk sequence number used.
const META_CHUNK_SEQ: &str = "keyset_chunk_seq";

/// Chunks read per engine call while loading the set or forgetting keys.
const SCAN_PAGE_CHUNKS: usize = 64;

/// A chunk's engine key: its expiry, then its sequence number (both big-endian, so chunks sort
/// by expiry).
pub fn chunk_key(expires_at_ms: u64, seq: u64) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&expires_at_ms.to_be_bytes());
    key[8..].copy_from_slice(&seq.to_be_bytes());
    key
}

/// The expiry of a chunk key; an error for a key this build did not write.
pub fn chunk_expiry(key: &[u8]) -> Result<u64, DecodeError> {
    chunk_key_parts(key).map(|(expiry, _)| expiry)
}

/// A chunk key's expiry and sequence number.
fn chunk_key_parts(key: &[u8]) -> Result<(u64, u64), DecodeError> {
    let bytes: &[u8; 16] = key
        .try_into()
        .map_err(|_| DecodeError(format!("key-set chunk key of {} bytes, not 16", key.len())))?;
    let (expiry, seq) = bytes.split_at(8);
    let word = |b: &[u8]| u64::from_be_bytes(b.try_into().expect("eight bytes"));
    Ok((word(expiry), word(seq)))
}

/// Writes a chunk's value into `out` (cleared first).
pub fn encode_chunk(namespace: &str, ids: &[KeyId], out: &mut Vec<u8>) {
    let len = u16::try_from(namespace.len()).expect("namespaces are at most 255 bytes");
    out.clear();
    out.reserve(3 + namespace.len() + ids.len() * 16);
    out.push(CHUNK_ENCODING_V1);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(namespace.as_bytes());
    for id in ids {
        out.extend_from_slice(id);
    }
}

/// A decoded chunk: its namespace and ids, borrowed from the value.
#[derive(Debug, PartialEq, Eq)]
pub struct Chunk<'a> {
    /// The namespace every id belongs to.
    pub namespace: &'a str,
    ids: &'a [u8],
}

impl<'a> Chunk<'a> {
    /// The ids, in the order they were written.
    pub fn ids(&self) -> impl ExactSizeIterator<Item = KeyId> + 'a {
        self.ids
            .chunks_exact(16)
            .map(|id| id.try_into().expect("sixteen bytes"))
    }
}

/// Reads a chunk's value; an error for anything this build did not write.
pub fn decode_chunk(value: &[u8]) -> Result<Chunk<'_>, DecodeError> {
    let bad = |what: &str| DecodeError(format!("key-set chunk: {what}"));
    let rest = match value {
        [CHUNK_ENCODING_V1, rest @ ..] => rest,
        [v, ..] => return Err(bad(&format!("encoding {v} is unknown"))),
        [] => return Err(bad("empty value")),
    };
    let (len, rest) = match rest {
        [a, b, rest @ ..] => (usize::from(u16::from_be_bytes([*a, *b])), rest),
        _ => return Err(bad("no namespace length")),
    };
    if rest.len() < len {
        return Err(bad("namespace cut short"));
    }
    let (namespace, ids) = rest.split_at(len);
    let namespace = std::str::from_utf8(namespace).map_err(|_| bad("namespace is not UTF-8"))?;
    if ids.len() % 16 != 0 {
        return Err(bad(&format!(
            "{} id bytes, not a multiple of 16",
            ids.len()
        )));
    }
    Ok(Chunk { namespace, ids })
}

/// Hashes an id by folding its bytes: ids are digests already, so SipHash's work buys nothing.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for part in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..part.len()].copy_from_slice(part);
            self.0 = (self.0.rotate_left(29) ^ u64::from_le_bytes(word))
                .wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn finish(&self) -> u64 {
        self.0 ^ (self.0 >> 31)
    }
}

type IdBuild = BuildHasherDefault<IdHasher>;

/// Tables of one namespace's ids; a power of two.
const ID_TABLES: usize = 64;

/// One namespace's ids (id -> latest expiry) in [`ID_TABLES`] tables chosen by hash. Each grows
/// and rehashes on its own, so no step moves millions of entries into a fresh allocation at
/// once: with one table, its rehashes (and the kernel zeroing their new pages) were a sixth of
/// a 3M-line ledger run's CPU.
#[derive(Debug)]
struct IdTable {
    tables: Vec<HashMap<KeyId, u64, IdBuild>>,
}

impl Default for IdTable {
    fn default() -> Self {
        Self {
            tables: (0..ID_TABLES).map(|_| HashMap::default()).collect(),
        }
    }
}

impl IdTable {
    fn table(&self, id: &KeyId) -> usize {
        let mut h = IdHasher::default();
        h.write(id);
        // Middle bits: the table's own hashing uses the low bits for the slot and the top seven
        // as each slot's tag.
        (h.finish() >> 32) as usize & (ID_TABLES - 1)
    }

    fn get(&self, id: &KeyId) -> Option<u64> {
        self.tables[self.table(id)].get(id).copied()
    }

    /// Stores `expires` for `id` unless it already has a later one; true when `id` is new here.
    fn raise(&mut self, id: KeyId, expires: u64) -> bool {
        let t = self.table(&id);
        match self.tables[t].entry(id) {
            std::collections::hash_map::Entry::Occupied(mut at) => {
                *at.get_mut() = (*at.get()).max(expires);
                false
            }
            std::collections::hash_map::Entry::Vacant(at) => {
                at.insert(expires);
                true
            }
        }
    }

    /// True when `id` was here.
    fn remove(&mut self, id: &KeyId) -> bool {
        let t = self.table(id);
        self.tables[t].remove(id).is_some()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.tables.iter().map(HashMap::len).sum()
    }
}

/// Every id of the set's chunks after [`Members::spilled_to`] with its latest expiry, per
/// namespace, as the last commit left it; the ids of the chunks up to it are in the per-key
/// index ([`SetTable::Index`]). The writer's alone; dropped whenever a write fails (reloaded
/// from the chunks by the next call).
#[derive(Debug, Default)]
pub(crate) struct Members {
    namespaces: HashMap<String, IdTable>,
    /// Ids held, over all namespaces.
    held: usize,
    /// Chunks whose keys sort up to this one (empty: none) have their ids in the index instead
    /// (persisted in meta as [`META_SPILLED_EXPIRY`] and [`META_SPILLED_SEQ`]).
    spilled_to: Vec<u8>,
    /// Whether the index may hold ids (then an id not held here is looked up there).
    index_in_use: bool,
    /// Buffers a call needs, kept between calls: allocating ~300 KiB afresh per call made the
    /// allocator hand pages back to the kernel and fault them in again.
    scratch: Scratch,
}

#[derive(Debug, Default)]
struct Scratch {
    /// Keys of the call's `check` seen so far.
    seen: HashSet<KeyId, IdBuild>,
    /// Keys of the call's `record`.
    recorded: HashSet<KeyId, IdBuild>,
    /// Keys the call stores.
    ids: Vec<KeyId>,
    /// A chunk's value.
    value: Vec<u8>,
}

impl Members {
    /// Reads every unexpired chunk after the spill mark. An undecodable one stops the load: the
    /// keys it holds are unknown, and "unreadable" must never read as "absent". Holds more than
    /// the memory limit until the call's writes spill the excess ([`Members::spill`]).
    fn load(txn: &mut dyn Txn, now_ms: u64) -> Result<Result<Members, Unreadable>, EngineError> {
        let mut members = Members {
            spilled_to: spill_mark(txn)?,
            ..Members::default()
        };
        let mut index_probe = Vec::new();
        txn.set_scan(
            SetTable::Index,
            (Bound::Unbounded, Bound::Unbounded),
            1,
            &mut index_probe,
        )?;
        members.index_in_use = !members.spilled_to.is_empty() || !index_probe.is_empty();
        let after = members.spilled_to.clone();
        let found = scan_from(
            txn,
            SetTable::Chunks,
            after,
            SCAN_PAGE_CHUNKS,
            &mut |key, value| {
                let expires_at_ms = chunk_expiry(key).map_err(|e| unreadable(key, e))?;
                if expires_at_ms <= now_ms {
                    return Ok(()); // the sweeper's
                }
                let chunk = decode_chunk(value).map_err(|e| unreadable(key, e))?;
                members.add(chunk.namespace, chunk.ids(), expires_at_ms);
                Ok(())
            },
        )?;
        Ok(found.map(|()| members))
    }

    fn add(&mut self, namespace: &str, ids: impl ExactSizeIterator<Item = KeyId>, expires: u64) {
        let set = match self.namespaces.get_mut(namespace) {
            Some(set) => set,
            None => self.namespaces.entry(namespace.to_owned()).or_default(),
        };
        for id in ids {
            self.held += usize::from(set.raise(id, expires));
        }
    }

    fn remove(&mut self, namespace: &str, id: &KeyId) {
        if let Some(set) = self.namespaces.get_mut(namespace) {
            self.held -= usize::from(set.remove(id));
        }
    }

    /// Whether `id` is known and unexpired at `now_ms`: held here, or else in the index.
    fn knows(
        &self,
        txn: &mut dyn Txn,
        namespace: &str,
        id: &KeyId,
        now_ms: u64,
    ) -> Result<Result<bool, Unreadable>, EngineError> {
        if self.holds(namespace, id, now_ms) {
            return Ok(Ok(true));
        }
        if !self.index_in_use {
            return Ok(Ok(false));
        }
        Ok(index_expiry(txn, namespace, id)?.map(|e| e.is_some_and(|at| at > now_ms)))
    }

    /// While more than `limit` ids are held, moves the ids of the chunks that expire first into
    /// the index (each under its latest expiry there) and the spill mark past them, down to
    /// three quarters of `limit`. Part of a call's writes: a crash part way leaves ids in both
    /// places, never in neither (the mark moves in the same commit, after the index entries).
    fn spill(&mut self, txn: &mut dyn Txn, limit: usize) -> Result<bool, EngineError> {
        if self.held <= limit {
            return Ok(false);
        }
        let target = limit - limit / 4;
        let mut page = Vec::with_capacity(SWEEP_PAGE_CHUNKS);
        let mut stuck = false;
        while self.held > target && !stuck {
            page.clear();
            let from = match self.spilled_to.is_empty() {
                true => Bound::Unbounded,
                false => Bound::Excluded(&self.spilled_to[..]),
            };
            txn.set_scan(
                SetTable::Chunks,
                (from, Bound::Unbounded),
                SWEEP_PAGE_CHUNKS,
                &mut page,
            )?;
            if page.is_empty() {
                break;
            }
            for (key, value) in &page {
                // A chunk that does not decode (the disk changed under us) stops the spill: the
                // mark must not pass ids that are not in the index.
                let (Ok(expires), Ok(chunk)) = (chunk_expiry(key), decode_chunk(value)) else {
                    tracing::error!(chunk = %hex(key), "spill stopped at a key-set chunk it could not read");
                    stuck = true;
                    break;
                };
                for id in chunk.ids() {
                    index_raise(txn, chunk.namespace, &id, expires)?;
                    if let Some(set) = self.namespaces.get_mut(chunk.namespace) {
                        if set.get(&id) == Some(expires) {
                            self.held -= usize::from(set.remove(&id));
                        }
                    }
                }
                self.spilled_to.clone_from(key);
                self.index_in_use = true;
                if self.held <= target {
                    break;
                }
            }
        }
        // Two writes, the sequence number first: a crash between them keeps the old expiry with
        // the new number, a mark that never sorts after the new one (the mark's expiry only
        // grows), so at worst some spilled chunks load again, their ids then in both places.
        // The other order could keep a mark past chunks whose ids never reached the index.
        // Empty (nothing passed yet) reads as (0, 0), the unset mark.
        let (expiry, seq) = chunk_key_parts(&self.spilled_to).unwrap_or((0, 0));
        txn.meta_put(META_SPILLED_SEQ, seq)?;
        txn.meta_put(META_SPILLED_EXPIRY, expiry)?;
        Ok(true)
    }

    /// Whether `id` is in the set and unexpired at `now_ms`.
    fn holds(&self, namespace: &str, id: &KeyId, now_ms: u64) -> bool {
        self.namespaces
            .get(namespace)
            .and_then(|set| set.get(id))
            .is_some_and(|expires| expires > now_ms)
    }

    /// Forgets the ids of an expired chunk whose latest expiry is the chunk's (a later chunk
    /// may have recorded an id again).
    fn remove_expired(&mut self, chunk: &Chunk<'_>, expires: u64) {
        if let Some(set) = self.namespaces.get_mut(chunk.namespace) {
            for id in chunk.ids() {
                if set.get(&id) == Some(expires) {
                    self.held -= usize::from(set.remove(&id));
                }
            }
        }
    }
}

/// Meta keys of the spill mark ([`Members::spilled_to`]): its expiry and sequence number; both
/// 0 (or absent) when nothing was spilled.
const META_SPILLED_EXPIRY: &str = "keyset_spilled_expiry";
const META_SPILLED_SEQ: &str = "keyset_spilled_seq";

/// The persisted spill mark: a chunk key, or empty.
fn spill_mark(txn: &mut dyn Txn) -> Result<Vec<u8>, EngineError> {
    let expiry = txn.meta_get(META_SPILLED_EXPIRY)?.unwrap_or(0);
    let seq = txn.meta_get(META_SPILLED_SEQ)?.unwrap_or(0);
    Ok(match (expiry, seq) {
        (0, 0) => Vec::new(),
        _ => chunk_key(expiry, seq).to_vec(),
    })
}

/// An index entry's key: the id, then the namespace (format 3's member key).
fn index_key(namespace: &str, id: &KeyId) -> Vec<u8> {
    [&id[..], namespace.as_bytes()].concat()
}

/// The expiry the index holds for `id` (`None`: absent); an entry this build cannot read is
/// [`Unreadable`], never "absent".
fn index_expiry(
    txn: &mut dyn Txn,
    namespace: &str,
    id: &KeyId,
) -> Result<Result<Option<u64>, Unreadable>, EngineError> {
    let key = index_key(namespace, id);
    let mut value = Vec::new();
    if !txn.set_get(SetTable::Index, &key, &mut value)? {
        return Ok(Ok(None));
    }
    Ok(decode_member_v3(&key, &value).map(|(_, _, expires)| Some(expires)))
}

/// Stores `expires` for `id` in the index unless it holds a later one. An entry this build
/// cannot read is left as it is (lookups of it keep failing, so an operator sees it; writing
/// over it could shorten a key's life).
fn index_raise(
    txn: &mut dyn Txn,
    namespace: &str,
    id: &KeyId,
    expires: u64,
) -> Result<(), EngineError> {
    match index_expiry(txn, namespace, id)? {
        Ok(Some(at)) if at >= expires => return Ok(()),
        Ok(_) => {}
        Err(e) => {
            tracing::error!(error = %e.0, "key-set index entry left as it is");
            return Ok(());
        }
    }
    let mut value = [0u8; 9];
    value[0] = INDEX_ENCODING_V1;
    value[1..].copy_from_slice(&expires.to_be_bytes());
    txn.set_put(SetTable::Index, &index_key(namespace, id), &value)
}

/// Version byte of an index entry's value (format 3's member encoding).
const INDEX_ENCODING_V1: u8 = 1;

/// What a call found that stops it before anything is written.
#[derive(Debug)]
pub(crate) struct Unreadable(pub String);

fn unreadable(key: &[u8], e: DecodeError) -> Unreadable {
    Unreadable(format!("key-set chunk {}: {}", hex(key), e.0))
}

/// What [`scan`] calls with each entry's key and value.
type EntryVisitor<'a> = dyn FnMut(&[u8], &[u8]) -> Result<(), Unreadable> + 'a;

/// Calls `each` with every entry of `table` (key, value) in key order, `page` at a time; stops
/// at the first `Err` it returns.
fn scan(
    txn: &mut dyn Txn,
    table: SetTable,
    page_len: usize,
    each: &mut EntryVisitor<'_>,
) -> Result<Result<(), Unreadable>, EngineError> {
    scan_from(txn, table, Vec::new(), page_len, each)
}

/// [`scan`] of the entries after `after` (empty: from the first).
fn scan_from(
    txn: &mut dyn Txn,
    table: SetTable,
    mut after: Vec<u8>,
    page_len: usize,
    each: &mut EntryVisitor<'_>,
) -> Result<Result<(), Unreadable>, EngineError> {
    let mut page = Vec::with_capacity(page_len);
    loop {
        page.clear();
        let from = if after.is_empty() {
            Bound::Unbounded
        } else {
            Bound::Excluded(&after[..])
        };
        txn.set_scan(table, (from, Bound::Unbounded), page_len, &mut page)?;
        for (key, value) in &page {
            if let Err(e) = each(key, value) {
                return Ok(Err(e));
            }
        }
        match page.pop() {
            Some((last, _)) if page.len() + 1 == page_len => after = last,
            _ => return Ok(Ok(())),
        }
    }
}

/// Runs `call` inside `txn` at `now_ms`: answers one bool per key of `check` (true: new), then
/// one per key of `forget` (true: a live member was removed), in `answers`. `members` is the
/// writer's in-memory set, loaded here when the call needs it. Reads come first: an unreadable
/// chunk stops the call before any write (`Ok(Err(..))`, nothing to commit, `members` as it
/// was). Returns whether anything was written; a caller whose commit then fails must drop
/// `members`.
pub(crate) fn apply(
    txn: &mut dyn Txn,
    (members, memory_ids): (&mut Option<Members>, usize),
    call: &KeySetCall,
    now_ms: u64,
    answers: &mut Vec<bool>,
) -> Result<Result<bool, Unreadable>, EngineError> {
    let ns = call.namespace.as_str();
    answers.clear();
    answers.resize(call.check.len() + call.forget.len(), false);
    // Keys to forget: every chunk of the namespace that holds one is rewritten without it (an
    // operator's rare `forget`, so a scan of the set; it needs no loaded set).
    let forgotten: HashSet<&KeyId, IdBuild> = call.forget.iter().collect();
    let mut rewrites: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    let mut index_removals: Vec<Vec<u8>> = Vec::new();
    if !forgotten.is_empty() {
        let forget_answers = &mut answers[call.check.len()..];
        let found = scan(
            txn,
            SetTable::Chunks,
            SCAN_PAGE_CHUNKS,
            &mut |key, value| {
                let expires_at_ms = chunk_expiry(key).map_err(|e| unreadable(key, e))?;
                let chunk = match decode_chunk(value) {
                    Ok(chunk) => chunk,
                    // An expired chunk holds nothing live: the sweeper removes it, readable or not.
                    Err(_) if expires_at_ms <= now_ms => return Ok(()),
                    Err(e) => return Err(unreadable(key, e)),
                };
                if chunk.namespace != ns || !chunk.ids().any(|id| forgotten.contains(&id)) {
                    return Ok(());
                }
                let mut kept = Vec::with_capacity(chunk.ids().len());
                for id in chunk.ids() {
                    if forgotten.contains(&id) {
                        if expires_at_ms > now_ms {
                            for (i, f) in call.forget.iter().enumerate() {
                                forget_answers[i] |= *f == id;
                            }
                        }
                    } else {
                        kept.push(id);
                    }
                }
                let mut value = Vec::new();
                if !kept.is_empty() {
                    encode_chunk(ns, &kept, &mut value);
                }
                rewrites.push((key.to_vec(), value));
                Ok(())
            },
        )?;
        if let Err(e) = found {
            return Ok(Err(e));
        }
        for (i, id) in call.forget.iter().enumerate() {
            match index_expiry(txn, ns, id)? {
                Ok(Some(at)) => {
                    answers[call.check.len() + i] |= at > now_ms;
                    index_removals.push(index_key(ns, id));
                }
                Ok(None) => {}
                Err(e) => return Ok(Err(e)),
            }
        }
    }
    if !call.check.is_empty() || !call.record.is_empty() {
        let set = match members {
            Some(set) => set,
            None => match Members::load(txn, now_ms)? {
                Ok(loaded) => members.insert(loaded),
                Err(e) => return Ok(Err(e)),
            },
        };
        // Lookups: a repeat within the call, or a key this call records, is not new.
        let mut scratch = std::mem::take(&mut set.scratch);
        let Scratch { seen, recorded, .. } = &mut scratch;
        recorded.clear();
        recorded.extend(call.record.iter().copied());
        seen.clear();
        let mut key = Vec::new();
        for (i, id) in call.check.iter().enumerate() {
            if !seen.insert(*id) || recorded.contains(id) {
                continue;
            }
            answers[i] = forgotten.contains(id)
                || match set.knows(txn, ns, id, now_ms)? {
                    Ok(known) => !known,
                    Err(e) => return Ok(Err(e)),
                };
            if answers[i] {
                if let Some(gate_key) = call.gate_keys.get(i) {
                    match gate_record_holds(txn, &call.namespace, gate_key, now_ms, &mut key)? {
                        Ok(held) => answers[i] = !held,
                        Err(e) => return Ok(Err(e)),
                    }
                }
            }
        }
        set.scratch = scratch;
    }
    // Writes, only once every read is done. Forgotten ids leave the loaded set before this
    // call's own records go in.
    let mut wrote = false;
    for (key, value) in &rewrites {
        if value.is_empty() {
            txn.set_remove(SetTable::Chunks, key)?;
        } else {
            txn.set_put(SetTable::Chunks, key, value)?;
        }
        wrote = true;
    }
    for key in &index_removals {
        txn.set_remove(SetTable::Index, key)?;
        wrote = true;
    }
    if let Some(set) = members.as_mut() {
        for id in &call.forget {
            set.remove(ns, id);
        }
    }
    let found_new = call.check.iter().zip(answers.iter()).filter(|(_, &n)| n);
    let found_new = found_new
        .map(|(id, _)| id)
        .take(if call.record_new { usize::MAX } else { 0 });
    let mut new_ids = call.record.iter().chain(found_new).peekable();
    if new_ids.peek().is_some() {
        let set = members.as_mut().expect("loaded for a call that records");
        let Scratch { ids, value, .. } = &mut set.scratch;
        ids.clear();
        ids.extend(new_ids.copied());
        let expires_at_ms = now_ms.saturating_add(call.ttl_ms);
        let mut seq = txn.meta_get(META_CHUNK_SEQ)?.unwrap_or(0);
        for part in ids.chunks(CHUNK_IDS_MAX) {
            seq += 1;
            encode_chunk(ns, part, value);
            txn.set_put(SetTable::Chunks, &chunk_key(expires_at_ms, seq), value)?;
        }
        txn.meta_put(META_CHUNK_SEQ, seq)?;
        let ids = std::mem::take(&mut set.scratch.ids);
        // A chunk that sorts before the spill mark (a shorter ttl than earlier calls') has its
        // ids in the index, like the chunks around it.
        let first = chunk_key(
            expires_at_ms,
            seq - ids.len().div_ceil(CHUNK_IDS_MAX) as u64 + 1,
        );
        if !set.spilled_to.is_empty() && first[..] <= set.spilled_to[..] {
            for id in &ids {
                index_raise(txn, ns, id, expires_at_ms)?;
            }
        } else {
            set.add(ns, ids.iter().copied(), expires_at_ms);
        }
        set.scratch.ids = ids;
        wrote = true;
    }
    if let Some(set) = members.as_mut() {
        wrote |= set.spill(txn, memory_ids)?;
    }
    Ok(Ok(wrote))
}

/// Whether the gate record of `gate_key` is live and would make a claim of it a duplicate
/// (completed, or in progress under a live lease). A key no gate record can have is not held;
/// an undecodable record is [`Unreadable`], never "absent".
fn gate_record_holds(
    txn: &mut dyn Txn,
    namespace: &Namespace,
    gate_key: &str,
    now_ms: u64,
    buf: &mut Vec<u8>,
) -> Result<Result<bool, Unreadable>, EngineError> {
    let Ok(id) = RecordId::new(namespace.as_str(), gate_key) else {
        return Ok(Ok(false));
    };
    encode_id(&id, buf);
    let mut value = Vec::new();
    if !txn.get(buf, &mut value)? {
        return Ok(Ok(false));
    }
    let entry = match decode_entry(&value) {
        Ok(e) => e,
        Err(e) => {
            let ns = namespace.as_str();
            return Ok(Err(Unreadable(format!("{ns} / {gate_key:?}: {e}"))));
        }
    };
    Ok(Ok(entry.holds(now_ms)))
}

/// What one step of the sweeper removed from the key set.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Swept {
    pub ids: u64,
    pub chunks: usize,
    /// Whether the step stopped at its budget with expired chunks possibly left.
    pub more: bool,
}

/// Chunks the sweeper reads at once (values of up to 64 KiB each).
const SWEEP_PAGE_CHUNKS: usize = 16;

/// One bounded step of the sweeper: removes whole chunks whose expiry has passed, oldest first
/// (chunks sort by expiry, so there is no walk), until about `max_ids` ids went (at least one
/// chunk, which can hold up to [`CHUNK_IDS_MAX`]), and their ids from `members` when the set is
/// loaded.
///
/// Disk use stays bounded by (new keys per second) x ttl plus one sweep interval. A chunk whose
/// value is undecodable but whose key says it expired is removed too: nothing in it is live.
pub(crate) fn sweep_step(
    txn: &mut dyn Txn,
    members: Option<&mut Members>,
    now_ms: u64,
    max_ids: usize,
) -> Result<Swept, EngineError> {
    // Chunks expired by now sort before the first key of the next millisecond; only those are
    // read. A removal is seen by the next read of the same transaction.
    let bound = chunk_key(now_ms.saturating_add(1), 0);
    let spilled_to = spill_mark(txn)?;
    let mut members = members;
    let mut swept = Swept::default();
    let mut page = Vec::with_capacity(SWEEP_PAGE_CHUNKS);
    loop {
        page.clear();
        let range = (Bound::Unbounded, Bound::Excluded(&bound[..]));
        txn.set_scan(SetTable::Chunks, range, SWEEP_PAGE_CHUNKS, &mut page)?;
        let mut removed_here = 0usize;
        for (key, value) in &page {
            let expires_at_ms = match chunk_expiry(key) {
                Ok(expires_at_ms) => expires_at_ms,
                Err(e) => {
                    tracing::error!(chunk = %hex(key), error = %e.0, "sweeper left a key-set entry with a foreign key");
                    continue; // left for an operator
                }
            };
            match decode_chunk(value) {
                Ok(chunk) if !spilled_to.is_empty() && key[..] <= spilled_to[..] => {
                    // Spilled: its ids are in the index, unless a later chunk raised them.
                    swept.ids += chunk.ids().len() as u64;
                    for id in chunk.ids() {
                        if let Ok(Some(at)) = index_expiry(txn, chunk.namespace, &id)? {
                            if at <= expires_at_ms {
                                txn.set_remove(SetTable::Index, &index_key(chunk.namespace, &id))?;
                            }
                        }
                    }
                }
                Ok(chunk) => {
                    swept.ids += chunk.ids().len() as u64;
                    if let Some(members) = members.as_deref_mut() {
                        members.remove_expired(&chunk, expires_at_ms);
                    }
                }
                Err(e) => tracing::warn!(
                    chunk = %hex(key), error = %e.0,
                    "sweeper removed an expired key-set chunk it could not read"
                ),
            }
            txn.set_remove(SetTable::Chunks, key)?;
            swept.chunks += 1;
            removed_here += 1;
            if swept.ids >= max_ids as u64 {
                swept.more = true;
                return Ok(swept);
            }
        }
        // A short page was the last; a page of nothing removable (foreign keys) would repeat.
        if page.len() < SWEEP_PAGE_CHUNKS || removed_here == 0 {
            return Ok(swept);
        }
    }
}

/// Format 3's members (one engine entry per key: 16 id bytes ++ namespace -> version byte ++
/// u64 big-endian expiry) rewritten as chunks, then removed, a page at a time (memory stays
/// bounded however large the set). A first pass reads every member and writes nothing: an
/// undecodable member stops the migration (the store does not open) before any change, as its
/// key would otherwise read as absent. In the second, each page's chunks are written before its
/// members are removed, so a crash part way leaves every key in one form or both, and the next
/// open (still format 3) migrates the rest. Returns how many members moved.
pub(crate) fn migrate_members(txn: &mut dyn Txn) -> Result<Result<u64, Unreadable>, EngineError> {
    const PAGE: usize = 10_000;
    let checked = scan(txn, SetTable::Index, PAGE, &mut |key, value| {
        decode_member_v3(key, value).map(drop)
    })?;
    if let Err(e) = checked {
        return Ok(Err(e));
    }
    let mut page = Vec::with_capacity(PAGE);
    let mut seq = txn.meta_get(META_CHUNK_SEQ)?.unwrap_or(0);
    let mut moved = 0u64;
    let mut value = Vec::new();
    loop {
        // Each page's members are gone once it is done: the next page starts from the front.
        page.clear();
        let all = (Bound::Unbounded, Bound::Unbounded);
        txn.set_scan(SetTable::Index, all, PAGE, &mut page)?;
        if page.is_empty() {
            break;
        }
        let mut groups: HashMap<(&str, u64), Vec<KeyId>> = HashMap::new();
        for (key, value) in &page {
            let (id, namespace, expires) = match decode_member_v3(key, value) {
                Ok(member) => member,
                Err(e) => return Ok(Err(e)), // read fine a moment ago: not expected
            };
            groups.entry((namespace, expires)).or_default().push(id);
        }
        for ((namespace, expires), ids) in &groups {
            for ids in ids.chunks(CHUNK_IDS_MAX) {
                seq += 1;
                encode_chunk(namespace, ids, &mut value);
                txn.set_put(SetTable::Chunks, &chunk_key(*expires, seq), &value)?;
            }
        }
        txn.meta_put(META_CHUNK_SEQ, seq)?;
        for (key, _) in &page {
            txn.set_remove(SetTable::Index, key)?;
        }
        moved += page.len() as u64;
    }
    Ok(Ok(moved))
}

/// An index entry's (a format-3 member's) id, namespace and expiry.
fn decode_member_v3<'a>(key: &'a [u8], value: &[u8]) -> Result<(KeyId, &'a str, u64), Unreadable> {
    let bad = |what: &str| Unreadable(format!("key-set index entry {}: {what}", hex(key)));
    let expires = match value {
        [INDEX_ENCODING_V1, rest @ ..] if rest.len() == 8 => {
            u64::from_be_bytes(rest.try_into().expect("eight bytes"))
        }
        _ => return Err(bad("unknown value")),
    };
    let (id, namespace) = match key.split_at_checked(16) {
        Some((id, ns)) if !ns.is_empty() => (id, ns),
        _ => return Err(bad("key too short")),
    };
    let namespace = std::str::from_utf8(namespace).map_err(|_| bad("namespace not UTF-8"))?;
    Ok((id.try_into().expect("sixteen bytes"), namespace, expires))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_round_trip_and_foreign_bytes_are_refused() {
        let ids = [[1u8; 16], [2u8; 16], [0xff; 16]];
        let mut value = Vec::new();
        encode_chunk("payments", &ids, &mut value);
        let chunk = decode_chunk(&value).unwrap();
        assert_eq!(chunk.namespace, "payments");
        assert_eq!(chunk.ids().collect::<Vec<_>>(), ids);
        encode_chunk("é", &[], &mut value);
        assert_eq!(decode_chunk(&value).unwrap().ids().len(), 0);
        for t in [0, 1, 1_700_000_000_000, u64::MAX] {
            assert_eq!(chunk_expiry(&chunk_key(t, 7)), Ok(t));
        }
        assert!(chunk_expiry(&[0; 15]).is_err());
        assert!(decode_chunk(&[]).is_err());
        assert!(decode_chunk(&[2, 0, 1, b'p']).is_err(), "unknown encoding");
        assert!(
            decode_chunk(&[1, 0, 5, b'p']).is_err(),
            "namespace cut short"
        );
        assert!(
            decode_chunk(&[1, 0, 1, b'p', 9, 9]).is_err(),
            "a partial id"
        );
        assert!(
            decode_chunk(&[1, 0, 1, 0xff]).is_err(),
            "namespace not UTF-8"
        );
    }

    #[test]
    fn chunk_keys_sort_by_expiry_then_sequence() {
        let keys = [
            chunk_key(5, 9),
            chunk_key(6, 1),
            chunk_key(6, 2),
            chunk_key(1 << 40, 0),
        ];
        assert!(keys.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn members_keep_the_latest_expiry_and_an_expired_chunk_takes_only_its_own() {
        let mut members = Members::default();
        let (a, b) = ([1u8; 16], [2u8; 16]);
        members.add("p", [a, b].into_iter(), 100);
        members.add("p", [a].into_iter(), 200);
        assert!(members.holds("p", &a, 150) && !members.holds("p", &b, 150));
        assert!(!members.holds("q", &a, 0), "namespaces are apart");
        let mut value = Vec::new();
        encode_chunk("p", &[a, b], &mut value);
        members.remove_expired(&decode_chunk(&value).unwrap(), 100);
        assert!(members.holds("p", &a, 150), "recorded again later: kept");
        assert_eq!(members.namespaces["p"].len(), 1);
    }
}
