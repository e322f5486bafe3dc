//! Names no other test run shares (topics, queues, groups, namespaces), in a file of its own so
//! that the binary crate's tests can include it with `#[path]` as well.

/// A unique name per test run: `prefix-<pid>-<random>`.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )
}
