//! [`Partitions`]: the partitions this consumer holds, each with its [`OffsetTracker`] and an
//! epoch, shared by the receive loop, the record tasks and the rebalance callbacks.
//!
//! A partition's epoch changes whenever it is assigned. A record task carries the epoch it was
//! taken under; once its partition is revoked (or revoked and assigned again), the task's
//! record no longer counts: it is neither retried nor settled, so its offset is not committed,
//! and the partition's next holder receives it again. The gate then holds its key until this
//! consumer's run (if any) completes, so the record is not run twice and not lost.
//!
//! A partition assigned again starts a fresh tracker at the first record received: librdkafka
//! fetches it from the committed position and discards records fetched under an earlier
//! assignment, so no record below that first one is still to come.

use std::collections::HashMap;
use std::sync::Mutex;

use rdkafka::{Offset, TopicPartitionList};

use super::offsets::{OffsetError, OffsetTracker};

/// A partition, as `(topic, partition)`.
pub(crate) type Tp = (String, i32);

#[derive(Debug)]
struct Held {
    epoch: u64,
    offsets: OffsetTracker,
}

/// Why a record was not taken.
#[derive(Debug, thiserror::Error)]
pub(crate) enum NotTaken {
    /// Its partition is not (or no longer) assigned here.
    #[error("partition not assigned to this consumer")]
    NotAssigned,
    /// Its offset is at or below one already taken.
    #[error(transparent)]
    Offset(#[from] OffsetError),
}

/// The held partitions.
#[derive(Debug, Default)]
pub(crate) struct Partitions {
    held: Mutex<HashMap<Tp, Held>>,
    epochs: Mutex<u64>,
}

impl Partitions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Tp, Held>> {
        // A panic while the lock was held cannot leave a tracker half-updated (each change is
        // one call), so a poisoned lock is still usable.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts holding the partitions in `tpl`, each under a new epoch and with nothing taken.
    pub(crate) fn assign(&self, tpl: &TopicPartitionList) {
        let mut epochs = self.epochs.lock().unwrap_or_else(|p| p.into_inner());
        let mut held = self.lock();
        for elem in tpl.elements() {
            *epochs += 1;
            held.insert(
                (elem.topic().to_owned(), elem.partition()),
                Held {
                    epoch: *epochs,
                    offsets: OffsetTracker::new(),
                },
            );
        }
    }

    /// Stops holding the partitions in `tpl`, returning the positions settled but not yet
    /// acknowledged, to commit before the partitions go.
    pub(crate) fn revoke(&self, tpl: &TopicPartitionList) -> TopicPartitionList {
        let mut held = self.lock();
        let mut out = TopicPartitionList::new();
        for elem in tpl.elements() {
            let tp = (elem.topic().to_owned(), elem.partition());
            if let Some(gone) = held.remove(&tp) {
                if let Some(position) = gone.offsets.to_commit() {
                    // The list only refuses a partition below -1; positions are ≥ 0.
                    let _ = out.add_partition_offset(&tp.0, tp.1, Offset::Offset(position));
                }
            }
        }
        out
    }

    /// Takes a record into hand; its epoch, for [`Partitions::settle`] and
    /// [`Partitions::holds`].
    pub(crate) fn take(&self, tp: &Tp, offset: i64) -> Result<u64, NotTaken> {
        let mut held = self.lock();
        let partition = held.get_mut(tp).ok_or(NotTaken::NotAssigned)?;
        partition.offsets.take(offset)?;
        Ok(partition.epoch)
    }

    /// True while `tp` is held under `epoch`.
    pub(crate) fn holds(&self, tp: &Tp, epoch: u64) -> bool {
        self.lock().get(tp).is_some_and(|p| p.epoch == epoch)
    }

    /// Settles a record taken under `epoch`; false (and nothing changes) when the partition was
    /// revoked since.
    pub(crate) fn settle(&self, tp: &Tp, epoch: u64, offset: i64) -> bool {
        let mut held = self.lock();
        match held.get_mut(tp) {
            Some(p) if p.epoch == epoch => p.offsets.settle(offset).is_ok(),
            _ => false,
        }
    }

    /// The positions to commit now, over all held partitions.
    pub(crate) fn to_commit(&self) -> TopicPartitionList {
        let held = self.lock();
        let mut out = TopicPartitionList::new();
        for ((topic, partition), p) in held.iter() {
            if let Some(position) = p.offsets.to_commit() {
                let _ = out.add_partition_offset(topic, *partition, Offset::Offset(position));
            }
        }
        out
    }

    /// Records the broker's acknowledgement of the positions in `tpl`.
    pub(crate) fn committed(&self, tpl: &TopicPartitionList) {
        let mut held = self.lock();
        for elem in tpl.elements() {
            if let (Some(p), Offset::Offset(position)) = (
                held.get_mut(&(elem.topic().to_owned(), elem.partition())),
                elem.offset(),
            ) {
                p.offsets.committed(position);
            }
        }
    }

    /// Records in hand over all partitions.
    pub(crate) fn in_flight(&self) -> usize {
        self.lock().values().map(|p| p.offsets.in_flight()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tpl(parts: &[i32]) -> TopicPartitionList {
        let mut t = TopicPartitionList::new();
        for p in parts {
            t.add_partition("t", *p);
        }
        t
    }

    fn positions(t: &TopicPartitionList) -> Vec<(i32, Offset)> {
        let mut v: Vec<_> = t
            .elements()
            .iter()
            .map(|e| (e.partition(), e.offset()))
            .collect();
        v.sort_by_key(|(p, _)| *p);
        v
    }

    #[test]
    fn a_revoked_partition_settles_nothing_and_a_reassigned_one_starts_afresh() {
        let parts = Partitions::default();
        let tp0 = ("t".to_owned(), 0);
        let tp1 = ("t".to_owned(), 1);
        assert!(matches!(parts.take(&tp0, 0), Err(NotTaken::NotAssigned)));
        parts.assign(&tpl(&[0, 1]));
        let e0 = parts.take(&tp0, 0).unwrap();
        parts.take(&tp0, 1).unwrap();
        let e1 = parts.take(&tp1, 5).unwrap();
        assert!(parts.settle(&tp0, e0, 0));
        assert!(parts.settle(&tp1, e1, 5));
        assert_eq!(parts.in_flight(), 1);
        assert_eq!(
            positions(&parts.to_commit()),
            [(0, Offset::Offset(1)), (1, Offset::Offset(6))]
        );
        parts.committed(&parts.to_commit());
        assert_eq!(positions(&parts.to_commit()), []);

        // Revoked with 0/1 in hand: nothing new to commit, and its late settle does not count.
        assert_eq!(positions(&parts.revoke(&tpl(&[0]))), []);
        assert!(!parts.holds(&tp0, e0));
        assert!(!parts.settle(&tp0, e0, 1));
        assert!(matches!(parts.take(&tp0, 2), Err(NotTaken::NotAssigned)));

        // Assigned again: a new epoch; the old task's settle still does not count, and the
        // redelivered record is taken afresh.
        parts.assign(&tpl(&[0]));
        assert!(!parts.holds(&tp0, e0));
        assert!(!parts.settle(&tp0, e0, 1));
        let again = parts.take(&tp0, 1).unwrap();
        assert_ne!(again, e0);
        assert!(parts.settle(&tp0, again, 1));
        assert_eq!(positions(&parts.to_commit()), [(0, Offset::Offset(2))]);
    }

    #[test]
    fn revoking_returns_what_is_settled_and_unacknowledged() {
        let parts = Partitions::default();
        let tp = ("t".to_owned(), 3);
        parts.assign(&tpl(&[3]));
        let e = parts.take(&tp, 10).unwrap();
        parts.take(&tp, 11).unwrap();
        parts.take(&tp, 12).unwrap();
        parts.settle(&tp, e, 10);
        parts.settle(&tp, e, 12);
        // 11 is in hand: only 10 is done, so the position is 11.
        assert_eq!(
            positions(&parts.revoke(&tpl(&[3]))),
            [(3, Offset::Offset(11))]
        );
        assert_eq!(positions(&parts.to_commit()), []);
    }
}
