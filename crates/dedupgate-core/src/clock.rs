//! The store's one clock. In-process stores judge ttl and leases on a [`Clock`]; remote stores
//! use the engine's own clock (Redis `TIME`, PostgreSQL `now()`), never a client's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of "now" in unix milliseconds.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    /// Unix epoch milliseconds.
    fn now_ms(&self) -> u64;
}

/// Wall-clock time that never runs backwards within a process: a step back of the system clock
/// holds time still instead, so a lease or fence is never judged on an earlier instant.
#[derive(Debug, Default)]
pub struct SystemClock {
    high_water_ms: AtomicU64,
}

impl SystemClock {
    /// A clock that starts at the system time, or at `floor_ms` if that is later (a store that
    /// persisted its last instant passes it here so a restart cannot move time back).
    pub fn with_floor(floor_ms: u64) -> Self {
        Self {
            high_water_ms: AtomicU64::new(floor_ms),
        }
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let prev = self.high_water_ms.fetch_max(wall, Ordering::AcqRel);
        prev.max(wall)
    }
}

/// A clock tests move by hand. Clones share the same time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now_ms: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock standing at `now_ms`.
    pub fn new(now_ms: u64) -> Self {
        Self {
            now_ms: Arc::new(AtomicU64::new(now_ms)),
        }
    }

    /// Moves time forward.
    pub fn advance(&self, ms: u64) {
        self.now_ms.fetch_add(ms, Ordering::AcqRel);
    }

    /// Sets the time (tests of clock steps may move it back).
    pub fn set(&self, now_ms: u64) {
        self.now_ms.store(now_ms, Ordering::Release);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_clock_never_goes_below_its_floor() {
        let far_future = 32_503_680_000_000; // year 3000
        let clock = SystemClock::with_floor(far_future);
        assert_eq!(clock.now_ms(), far_future);
    }

    #[test]
    fn manual_clock_clones_share_time() {
        let a = ManualClock::new(10);
        let b = a.clone();
        a.advance(5);
        assert_eq!(b.now_ms(), 15);
    }
}
