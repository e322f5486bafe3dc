//! A STORE opened together with its key set, for `dedup`'s ledger: the one place that knows
//! which stores keep one natively, so a face asks for it through the core's [`KeySet`] trait
//! and never names the store.

use std::sync::Arc;

use dedupgate_core::{KeySet, Store};

#[cfg(feature = "embedded")]
use crate::{open, OpenStoreError, StoreSpec};

#[cfg(feature = "embedded")]
pub use dedupgate_embedded::keyset::MEMORY_IDS_DEFAULT as KEY_SET_MEMORY_IDS_DEFAULT;
#[cfg(feature = "embedded")]
pub use dedupgate_embedded::EmbeddedOptions;

/// An open store, and the same store as a [`KeySet`] when it keeps one.
pub type WithKeySet = (Arc<dyn Store>, Option<Arc<dyn KeySet>>);

/// Opens the store `spec` names, as [`open`] does but with `embedded` options for an embedded
/// store, and hands back its key set when it keeps one (the embedded store; any other keeps a
/// ledger as gate records).
#[cfg(feature = "embedded")]
pub async fn open_with_key_set(
    spec: &StoreSpec,
    embedded: EmbeddedOptions,
) -> Result<WithKeySet, OpenStoreError> {
    match spec {
        StoreSpec::Embedded(dir) => {
            let store = crate::open_embedded(dir, embedded).await?;
            Ok((store.clone(), Some(store)))
        }
        _ => Ok((open(spec).await?, None)),
    }
}

#[cfg(all(test, feature = "embedded"))]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_an_embedded_store_hands_out_a_key_set() {
        let dir = std::env::temp_dir().join(format!("dedupgate-key-set-{}", std::process::id()));
        let spec = StoreSpec::Embedded(dir.clone());
        let (_, key_set) = open_with_key_set(&spec, EmbeddedOptions::default())
            .await
            .unwrap();
        let key_set = key_set.expect("the embedded store keeps a key set");
        let call = dedupgate_core::KeySetCall {
            namespace: dedupgate_core::Namespace::new("ns").unwrap(),
            record: Vec::new(),
            check: vec![[7; 16], [7; 16]],
            record_new: true,
            gate_keys: Vec::new(),
            ttl_ms: 60_000,
            forget: Vec::new(),
        };
        assert_eq!(key_set.key_set(call).await.unwrap(), vec![true, false]);
        drop(key_set);
        let (_, none) = open_with_key_set(&StoreSpec::Memory, EmbeddedOptions::default())
            .await
            .unwrap();
        assert!(none.is_none());
        let _ = std::fs::remove_dir_all(dir);
    }
}
