//! What the writer shares with the store's callers: the requests they send it, and the state
//! they read beside it (availability, counters, the published durable view, the ids in flight).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dedupgate_core::{GateError, Outcome, RecordId, StoreError, StoreStats, ValidOp};
use tokio::sync::oneshot;

use crate::engine::DurableView;
use crate::keyset::KeySetCall;

pub(crate) type Answer = Result<Outcome, GateError>;

/// What callers send the writer.
pub(crate) enum Request {
    One {
        id: RecordId,
        op: ValidOp,
        reply: oneshot::Sender<Answer>,
    },
    Many {
        ops: Vec<(RecordId, ValidOp)>,
        reply: oneshot::Sender<Vec<Answer>>,
    },
    Sweep {
        batch_max: usize,
        /// How many entries went, and whether expired records remain.
        reply: oneshot::Sender<Result<(u64, bool), StoreError>>,
    },
    Stats {
        reply: oneshot::Sender<Result<StoreStats, StoreError>>,
    },
    KeySet {
        call: KeySetCall,
        /// One bool per key checked: true when it was new.
        reply: oneshot::Sender<Result<Vec<bool>, GateError>>,
    },
}

/// State the writer shares with the store's callers.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// False from a failed write until the engine has reopened cleanly.
    pub available: AtomicBool,
    /// Why the store is unavailable, for health answers.
    pub last_error: Mutex<String>,
    pub swept_total: AtomicU64,
    pub commits_total: AtomicU64,
    /// The last durable commit's view; `None` while the store is failed closed.
    pub view: ViewSlot,
    /// The ids the commit in flight may change, for callers answering from the view.
    pub pending: PendingIds,
}

/// Which ids the commit in flight may change, as bits of their hash, and an epoch that is odd
/// while a commit is in flight. A caller answers from the view only for an id no commit in flight
/// touches, and only if no commit began or ended meanwhile: otherwise the writer decides the id
/// at an instant earlier than the caller's, and the store's clock would appear to step back along
/// the order of operations on that key.
#[derive(Debug)]
pub(crate) struct PendingIds {
    epoch: AtomicU64,
    bits: Box<[AtomicU64]>,
}

/// Bits in [`PendingIds`]; a collision only sends an op to the writer.
const PENDING_BITS: usize = 1 << 16;

impl Default for PendingIds {
    fn default() -> Self {
        Self {
            epoch: AtomicU64::new(0),
            bits: (0..PENDING_BITS / 64).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl PendingIds {
    pub(crate) fn slot(id_bytes: &[u8]) -> (usize, u64) {
        // The storage key starts with a 32-bit hash of the id.
        let mut h = [0u8; 4];
        let n = id_bytes.len().min(4);
        h[..n].copy_from_slice(&id_bytes[..n]);
        let bit = u32::from_be_bytes(h) as usize % PENDING_BITS;
        (bit / 64, 1u64 << (bit % 64))
    }

    /// The current epoch (odd: a commit is in flight).
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Whether the commit in flight may change the id stored under `id_bytes`.
    pub(crate) fn may_change(&self, id_bytes: &[u8]) -> bool {
        let (word, mask) = Self::slot(id_bytes);
        self.bits[word].load(Ordering::Acquire) & mask != 0
    }

    /// Marks the slots of a commit's ids, then makes the epoch odd: before it decides anything.
    pub(crate) fn begin(&self, slots: &[(usize, u64)]) {
        for &(word, mask) in slots {
            self.bits[word].fetch_or(mask, Ordering::Relaxed);
        }
        self.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// Makes the epoch even, then clears the commit's slots: once its view is published.
    pub(crate) fn end(&self, slots: &[(usize, u64)]) {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        for &(word, mask) in slots {
            self.bits[word].fetch_and(!mask, Ordering::Relaxed);
        }
    }
}

/// Where the writer publishes its [`DurableView`] for callers.
#[derive(Default)]
pub(crate) struct ViewSlot(std::sync::RwLock<Option<Arc<dyn DurableView>>>);

impl ViewSlot {
    pub(crate) fn get(&self) -> Option<Arc<dyn DurableView>> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn set(&self, view: Option<Arc<dyn DurableView>>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = view;
    }
}

impl std::fmt::Debug for ViewSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ViewSlot")
    }
}

impl Shared {
    pub(crate) fn unavailable(&self) -> StoreError {
        let why = self
            .last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        StoreError::Unavailable(format!(
            "the embedded store failed closed and is reopening: {why}"
        ))
    }
}
