//! Tiered store (work in progress).
