//! Cluster grouping: a batch's ops split into one group per slot (a pipeline on a cluster may not
//! cross slots), and how many groups go out at once.

use std::collections::BTreeMap;

use crate::store::Prepared;

/// Most slot groups of one batch in flight at once on a cluster.
pub(crate) const CLUSTER_GROUPS_IN_FLIGHT_MAX: usize = 64;

/// Splits ops into groups of one cluster slot each, keeping their order within a group.
pub(crate) fn by_slot(prepared: Vec<Prepared>) -> Vec<Vec<Prepared>> {
    let mut by_slot: BTreeMap<u16, Vec<Prepared>> = BTreeMap::new();
    for p in prepared {
        by_slot.entry(p.keys.slot).or_default().push(p);
    }
    by_slot.into_values().collect()
}
