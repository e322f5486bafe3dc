//! Every subcommand's `--help` ends with its exit status, and docs/cli.md tables the same codes:
//! the two are read and compared here, so neither can drift.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

fn help(args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_dedupgate"))
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{args:?}");
    String::from_utf8(o.stdout).unwrap()
}

/// The subcommands `dedupgate --help` lists (without `help`).
fn subcommands() -> Vec<String> {
    let top = help(&["--help"]);
    top.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .filter(|c| c != "help")
        .collect()
}

/// The codes listed under "Exit status:" (the first word of each entry).
fn help_codes(text: &str) -> BTreeSet<String> {
    text.lines()
        .skip_while(|l| *l != "Exit status:")
        .skip(1)
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

/// docs/cli.md's exit status tables: for each line naming "Exit status of `a`, `b`", the
/// subcommands it names and the codes (first backquoted word of each row) of the table after it.
fn docs_tables() -> Vec<(Vec<String>, BTreeSet<String>)> {
    let docs = include_str!("../../../docs/cli.md");
    let ticked =
        |l: &str| -> Vec<String> { l.split('`').skip(1).step_by(2).map(str::to_owned).collect() };
    let lines: Vec<&str> = docs.lines().collect();
    let mut tables = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if !line
            .trim_start_matches("### ")
            .starts_with("Exit status of ")
        {
            continue;
        }
        let codes = lines[i + 1..]
            .iter()
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .filter(|l| l.starts_with("| `"))
            .filter_map(|l| ticked(l).into_iter().next())
            .collect();
        tables.push((ticked(line), codes));
    }
    tables
}

#[test]
fn every_subcommands_help_lists_its_exit_status_as_docs_cli_md_does() {
    let subcommands = subcommands();
    assert!(subcommands.len() >= 14, "{subcommands:?}");
    let mut codes = BTreeMap::new();
    for sub in &subcommands {
        let text = help(&[sub, "--help"]);
        let listed = help_codes(&text);
        assert!(
            listed.contains("0") && listed.contains("2"),
            "{sub} --help lists no exit status: {text}"
        );
        assert_eq!(
            help_codes(&help(&[sub, "-h"])),
            listed,
            "{sub} -h and --help differ"
        );
        codes.insert(sub.clone(), listed);
    }
    let tables = docs_tables();
    let mut documented = BTreeSet::new();
    for (names, doc_codes) in &tables {
        let mut union = BTreeSet::new();
        for name in names {
            let listed = codes
                .get(name)
                .unwrap_or_else(|| panic!("docs/cli.md tables `{name}`, no such subcommand"));
            assert!(
                listed.is_subset(doc_codes),
                "{name} --help lists {listed:?}, docs/cli.md {doc_codes:?}"
            );
            union.extend(listed.iter().cloned());
            assert!(documented.insert(name.clone()), "{name} tabled twice");
        }
        assert_eq!(&union, doc_codes, "docs/cli.md's table for {names:?}");
    }
    let missing: Vec<_> = subcommands
        .iter()
        .filter(|s| !documented.contains(*s))
        .collect();
    assert!(
        missing.is_empty(),
        "no exit status table in docs/cli.md: {missing:?}"
    );
}
