//! The two harnesses every store's suite needs: a store on a clock the suite moves by hand, and
//! a store that judges time on a server's clock, where time passes as a real sleep.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use super::Harness;
use crate::{ManualClock, Store};

/// A store that reads `clock`, so [`Harness::advance`] moves time at once instead of sleeping.
pub struct ClockedHarness {
    /// The clock the store was opened with.
    pub clock: ManualClock,
    /// The store under test.
    pub store: Arc<dyn Store>,
}

#[async_trait]
impl Harness for ClockedHarness {
    fn store(&self) -> Arc<dyn Store> {
        self.store.clone()
    }

    async fn advance(&self, ms: u64) {
        self.clock.advance(ms);
    }
}

/// A store that judges time on its server's clock (Redis, PostgreSQL, a tier of either), so the
/// suite's time passes as a real sleep.
pub struct RealTimeHarness(pub Arc<dyn Store>);

#[async_trait]
impl Harness for RealTimeHarness {
    fn store(&self) -> Arc<dyn Store> {
        self.0.clone()
    }

    async fn advance(&self, ms: u64) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}
