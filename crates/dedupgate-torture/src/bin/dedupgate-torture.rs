//! `dedupgate-torture`: the harness's command line.

fn main() {}
