//! [`OffsetTracker`]: which offset of one partition may be committed while its records are
//! handled concurrently and settle in any order.
//!
//! Kafka commits a position, not a set of records: committing `n` says every record below `n`
//! is done. So the committable position is the lowest offset still unsettled, or one past the
//! highest offset taken when none is. Offsets may have gaps (compaction, transaction markers),
//! which is why the tracker keeps the unsettled offsets themselves rather than counting.
//!
//! Invariants: every unsettled offset is below `next`; the committable position never moves
//! back; a position is offered for commit until the broker acknowledged it or a later one.

use std::collections::BTreeSet;

/// Why the tracker refused an offset. Either is a bug in the caller or a broker that went
/// backwards; the record is not taken, and nothing committed moves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OffsetError {
    /// Offsets are taken in increasing order; this one is at or below one already taken (a
    /// redelivery after a seek: the record is already in hand or settled).
    #[error("offset {offset} is not after the last taken ({last})")]
    NotAfter {
        /// The refused offset.
        offset: i64,
        /// The highest offset taken so far.
        last: i64,
    },
    /// A negative offset: Kafka's offsets start at 0.
    #[error("offset {0} is negative")]
    Negative(i64),
    /// Settling an offset that was never taken or is already settled.
    #[error("offset {0} is not unsettled")]
    NotPending(i64),
}

/// One partition's records in hand, from the first taken after its assignment on.
#[derive(Debug, Clone, Default)]
pub struct OffsetTracker {
    /// Offsets taken and not yet settled.
    pending: BTreeSet<i64>,
    /// One past the highest offset taken; `None` before the first.
    next: Option<i64>,
    /// The highest position the broker acknowledged ([`OffsetTracker::committed`]).
    committed: Option<i64>,
}

impl OffsetTracker {
    /// An empty tracker: nothing taken, nothing to commit.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the record at `offset` into hand: it must be above every offset taken before.
    pub fn take(&mut self, offset: i64) -> Result<(), OffsetError> {
        if offset < 0 {
            return Err(OffsetError::Negative(offset));
        }
        if let Some(next) = self.next {
            if offset < next {
                return Err(OffsetError::NotAfter {
                    offset,
                    last: next - 1,
                });
            }
        }
        self.pending.insert(offset);
        // offset ≥ 0, so offset + 1 cannot overflow below i64::MAX; saturate at the top.
        self.next = Some(offset.saturating_add(1));
        Ok(())
    }

    /// Settles the record at `offset` (completed, duplicate or dead-lettered).
    pub fn settle(&mut self, offset: i64) -> Result<(), OffsetError> {
        if self.pending.remove(&offset) {
            Ok(())
        } else {
            Err(OffsetError::NotPending(offset))
        }
    }

    /// The position that may be committed now: the lowest unsettled offset, or one past the
    /// highest taken when all are settled; `None` before the first record.
    pub fn committable(&self) -> Option<i64> {
        self.pending.first().copied().or(self.next)
    }

    /// The committable position when it is past the last one the broker acknowledged. It is
    /// offered again until acknowledged: a commit that failed or is still under way is simply
    /// sent again (committing a position twice is harmless; skipping one is not, when no later
    /// record comes to supersede it).
    pub fn to_commit(&self) -> Option<i64> {
        let position = self.committable()?;
        match self.committed {
            Some(done) if done >= position => None,
            _ => Some(position),
        }
    }

    /// Records that the broker acknowledged a commit of `position` (a late acknowledgement of
    /// an older position changes nothing).
    pub fn committed(&mut self, position: i64) {
        self.committed = Some(self.committed.map_or(position, |done| done.max(position)));
    }

    /// How many records are in hand.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// The lowest unsettled offset, the one holding the partition's commit back.
    pub fn oldest_pending(&self) -> Option<i64> {
        self.pending.first().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_taken_commits_nothing() {
        let t = OffsetTracker::new();
        assert_eq!(t.committable(), None);
        assert_eq!(t.to_commit(), None);
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn the_commit_stops_at_the_lowest_unsettled_offset() {
        let mut t = OffsetTracker::new();
        for o in 10..15 {
            t.take(o).unwrap();
        }
        assert_eq!(t.committable(), Some(10));
        // Later records settle first: nothing below the held one is committable past it.
        t.settle(12).unwrap();
        t.settle(14).unwrap();
        assert_eq!(t.committable(), Some(10));
        t.settle(10).unwrap();
        assert_eq!(t.committable(), Some(11));
        t.settle(11).unwrap();
        assert_eq!(t.committable(), Some(13));
        t.settle(13).unwrap();
        assert_eq!(t.committable(), Some(15));
        assert_eq!(t.in_flight(), 0);
    }

    #[test]
    fn gaps_in_offsets_commit_past_them() {
        let mut t = OffsetTracker::new();
        for o in [3, 7, 8, 20] {
            t.take(o).unwrap();
        }
        t.settle(3).unwrap();
        assert_eq!(t.committable(), Some(7));
        t.settle(8).unwrap();
        t.settle(7).unwrap();
        assert_eq!(t.committable(), Some(20));
        t.settle(20).unwrap();
        assert_eq!(t.committable(), Some(21));
    }

    #[test]
    fn a_position_is_offered_until_acknowledged_and_never_backwards() {
        let mut t = OffsetTracker::new();
        t.take(0).unwrap();
        t.take(1).unwrap();
        assert_eq!(t.to_commit(), Some(0));
        assert_eq!(
            t.to_commit(),
            Some(0),
            "not acknowledged yet: offered again"
        );
        t.committed(0);
        assert_eq!(t.to_commit(), None, "acknowledged");
        t.settle(1).unwrap();
        assert_eq!(
            t.to_commit(),
            None,
            "1 settled, 0 still holds the partition"
        );
        t.settle(0).unwrap();
        assert_eq!(t.to_commit(), Some(2));
        // A late acknowledgement of an older position does not take 2's place.
        t.committed(2);
        t.committed(1);
        assert_eq!(t.to_commit(), None);
        t.take(5).unwrap();
        // 5 is in hand: the position moves to 5 (2, 3 and 4 do not exist or were compacted).
        assert_eq!(t.to_commit(), Some(5));
        t.committed(5);
        assert_eq!(t.to_commit(), None);
    }

    #[test]
    fn offsets_must_increase_and_be_known_to_settle() {
        let mut t = OffsetTracker::new();
        t.take(4).unwrap();
        assert_eq!(t.take(4), Err(OffsetError::NotAfter { offset: 4, last: 4 }));
        assert_eq!(t.take(2), Err(OffsetError::NotAfter { offset: 2, last: 4 }));
        assert_eq!(t.take(-1), Err(OffsetError::Negative(-1)));
        assert_eq!(t.settle(3), Err(OffsetError::NotPending(3)));
        t.settle(4).unwrap();
        assert_eq!(
            t.settle(4),
            Err(OffsetError::NotPending(4)),
            "settled twice"
        );
        // Refusals changed nothing.
        assert_eq!(t.committable(), Some(5));
        t.take(i64::MAX).unwrap();
        t.settle(i64::MAX).unwrap();
        assert_eq!(t.committable(), Some(i64::MAX));
    }

    /// Random interleavings against a model: the committable position is always the first
    /// offset (in take order) not yet settled, or one past the last taken.
    #[test]
    fn random_settle_orders_match_the_model() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        println!("seed {seed}");
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for _ in 0..200 {
            let mut t = OffsetTracker::new();
            let mut taken: Vec<(i64, bool)> = Vec::new();
            let mut next = rng.gen_range(0..5);
            let mut last_reported = None;
            for _ in 0..rng.gen_range(1..60) {
                let unsettled: Vec<usize> = (0..taken.len()).filter(|&i| !taken[i].1).collect();
                if unsettled.is_empty() || rng.gen_bool(0.5) {
                    t.take(next).unwrap();
                    taken.push((next, false));
                    next += rng.gen_range(1..4);
                } else {
                    let i = unsettled[rng.gen_range(0..unsettled.len())];
                    t.settle(taken[i].0).unwrap();
                    taken[i].1 = true;
                }
                let model = taken
                    .iter()
                    .find(|(_, settled)| !settled)
                    .map(|(o, _)| *o)
                    .or(taken.last().map(|(o, _)| o + 1));
                assert_eq!(t.committable(), model, "seed {seed}: {taken:?}");
                if let Some(p) = t.to_commit() {
                    assert!(last_reported < Some(p), "seed {seed}: went back");
                    if rng.gen_bool(0.7) {
                        t.committed(p);
                        last_reported = Some(p);
                    }
                }
                assert_eq!(
                    t.in_flight(),
                    taken.iter().filter(|(_, s)| !s).count(),
                    "seed {seed}"
                );
            }
        }
    }
}
