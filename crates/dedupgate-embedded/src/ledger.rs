//! The embedded store as the core's [`KeySet`]: its key set, reached through the trait so that
//! faces need not name the embedded store to use it.

use async_trait::async_trait;
use dedupgate_core::{GateError, KeySet, KeySetCall};

use crate::EmbeddedStore;

#[async_trait]
impl KeySet for EmbeddedStore {
    async fn key_set(&self, call: KeySetCall) -> Result<Vec<bool>, GateError> {
        EmbeddedStore::key_set(self, call).await
    }
}
