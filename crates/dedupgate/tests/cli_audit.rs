//! End-to-end tests of `dedupgate audit`: files as a table or JSON with exit 1 on duplicates,
//! reconciliation `--against` a source per key and per window, and a PostgreSQL table and
//! query (the local server, `DEDUPGATE_TEST_POSTGRES_URL` to override).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
#[cfg(feature = "postgres")]
use std::time::{SystemTime, UNIX_EPOCH};

fn dg() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dedupgate"));
    c.env("RUST_LOG", "warn");
    c
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, text).unwrap();
    p
}

fn rows(spec: &[(u32, u32)]) -> String {
    // (order id, minute): one row each.
    spec.iter()
        .map(|(id, m)| {
            format!(
                "{{\"order\":{id},\"ts\":\"2026-03-01T{:02}:{:02}:00Z\"}}\n",
                10 + m / 60,
                m % 60
            )
        })
        .collect()
}

#[test]
fn counts_duplicates_as_a_table_and_as_json_and_exits_1() {
    let dir = tempfile::tempdir().unwrap();
    let dupes = write(
        dir.path(),
        "d.jsonl",
        &(rows(&[(1, 0), (2, 0), (1, 5), (3, 9), (1, 7), (2, 8)]) + "broken\n"),
    );
    let o = dg()
        .args(["audit", "--key-fields", "order"])
        .arg(&dupes)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", err(&o));
    let t = out(&o);
    for want in [
        "rows",
        "6",
        "distinct keys",
        "3",
        "duplicated keys",
        "2",
        "extra copies",
        "rejected",
        "d.jsonl:7: malformed JSON",
        "{\"order\": 1}",
    ] {
        assert!(t.contains(want), "{want:?} in\n{t}");
    }
    let o = dg()
        .args(["audit", "--key-fields", "order", "--json", "--top", "1"])
        .arg(&dupes)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(v["rows"], 6);
    assert_eq!(v["distinct_keys"], 3);
    assert_eq!(v["duplicated_keys"], 2);
    assert_eq!(v["extra_copies"], 3);
    assert_eq!(v["rejected"], 1);
    assert_eq!(
        v["top"],
        serde_json::json!([{"key": "{\"order\": 1}", "count": 3}])
    );

    let clean = write(dir.path(), "c.csv", "order,ts\n1,a\n2,b\n");
    let o = dg()
        .args(["audit", "--key-fields", "order"])
        .arg(&clean)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let o = dg()
        .args(["audit", "--key-fields", "nope"])
        .arg(&clean)
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(2),
        "an audit that cannot be done is not a clean one"
    );
}

#[test]
fn reconciles_a_destination_with_its_source_per_key_and_per_window() {
    let dir = tempfile::tempdir().unwrap();
    // The source legitimately holds order 5 twice; the destination copied order 2 twice
    // (window 10:00) and order 7 three times (window 11:00).
    let source = write(
        dir.path(),
        "src.jsonl",
        &rows(&[(1, 0), (2, 10), (5, 20), (5, 21), (7, 70)]),
    );
    let dest = write(
        dir.path(),
        "dst.jsonl",
        &rows(&[
            (1, 0),
            (2, 10),
            (2, 10),
            (5, 20),
            (5, 21),
            (7, 70),
            (7, 70),
            (7, 70),
        ]),
    );
    let o = dg()
        .args([
            "audit",
            "--key-fields",
            "order",
            "--window-field",
            "ts",
            "--window",
            "1h",
            "--json",
            "--against",
        ])
        .arg(&source)
        .arg(&dest)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    let a = &v["against"];
    assert_eq!(a["source_rows"], 5);
    assert_eq!(a["keys_over_source"], 2);
    assert_eq!(
        a["keys_over"],
        serde_json::json!([
            {"key": "{\"order\": 7}", "destination": 3, "source": 1},
            {"key": "{\"order\": 2}", "destination": 2, "source": 1},
        ])
    );
    assert_eq!(
        a["windows_over"],
        serde_json::json!([
            {"window": "2026-03-01T10:00:00Z", "destination": 5, "source": 4},
            {"window": "2026-03-01T11:00:00Z", "destination": 3, "source": 1},
        ])
    );
    // The table names the windows too.
    let o = dg()
        .args([
            "audit",
            "--key-fields",
            "order",
            "--window-field",
            "ts",
            "--window",
            "1h",
            "--against",
        ])
        .arg(&source)
        .arg(&dest)
        .output()
        .unwrap();
    assert!(out(&o).contains("2026-03-01T11:00:00Z"), "{}", out(&o));
    // A destination equal to its source is clean, its own duplicates included.
    let o = dg()
        .args([
            "audit",
            "--key-fields",
            "order",
            "--window-field",
            "ts",
            "--window",
            "1h",
            "--against",
        ])
        .arg(&source)
        .arg(&source)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", out(&o));
}

/// A table in the local PostgreSQL, dropped on drop.
#[cfg(feature = "postgres")]
struct Table {
    url: String,
    name: String,
}

#[cfg(feature = "postgres")]
impl Drop for Table {
    fn drop(&mut self) {
        let _ = psql(&self.url, &format!("DROP TABLE IF EXISTS {}", self.name));
    }
}

#[cfg(feature = "postgres")]
fn psql(url: &str, sql: &str) -> Output {
    Command::new("psql")
        .args([url, "-v", "ON_ERROR_STOP=1", "-qAtc", sql])
        .output()
        .expect("psql runs")
}

#[cfg(feature = "postgres")]
#[test]
fn audits_a_postgres_table_and_query() {
    let url = std::env::var("DEDUPGATE_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let table = Table {
        url: url.clone(),
        name: format!("audit_t_{}_{nanos}", std::process::id()),
    };
    let created = psql(
        &url,
        &format!(
            "CREATE TABLE {0} (order_id bigint, amount numeric, note text, ts timestamptz); \
             INSERT INTO {0} VALUES (1, 9.50, 'a', '2026-03-01T10:00:00Z'), (2, 1, 'b', '2026-03-01T10:01:00Z'), \
             (1, 9.50, 'c', '2026-03-01T10:02:00Z'), (3, 2, 'é', '2026-03-01T11:00:00Z')",
            table.name
        ),
    );
    assert!(created.status.success(), "{}", err(&created));
    let o = dg()
        .args([
            "audit",
            "--key-fields",
            "order_id,amount",
            "--json",
            "--postgres",
            &url,
            "--table",
            &table.name,
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(v["rows"], 4);
    assert_eq!(v["duplicated_keys"], 1);
    assert_eq!(v["top"][0]["key"], "{\"amount\": 9.5, \"order_id\": 1}");
    let o = dg()
        .args([
            "audit",
            "--key-fields",
            "order_id",
            "--postgres",
            &url,
            "--query",
        ])
        .arg(format!(
            "SELECT DISTINCT ON (order_id) * FROM {} ORDER BY order_id, ts",
            table.name
        ))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{} {}", out(&o), err(&o));
    // The table reconciled against a file export of its source, per hour.
    let dir = tempfile::tempdir().unwrap();
    let source = write(
        dir.path(),
        "src.jsonl",
        "{\"order_id\":1,\"ts\":\"2026-03-01T10:00:00Z\"}\n{\"order_id\":2,\"ts\":\"2026-03-01T10:01:00Z\"}\n{\"order_id\":3,\"ts\":\"2026-03-01T11:00:00Z\"}\n",
    );
    let o = dg()
        .args([
            "audit",
            "--key-fields",
            "order_id",
            "--window-field",
            "ts",
            "--window",
            "1h",
            "--json",
            "--postgres",
            &url,
            "--table",
            &table.name,
            "--against",
        ])
        .arg(&source)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(v["against"]["keys_over_source"], 1);
    assert_eq!(
        v["against"]["windows_over"][0]["window"],
        "2026-03-01T10:00:00Z"
    );
    let bad = dg()
        .args([
            "audit",
            "--key-fields",
            "a",
            "--postgres",
            &url,
            "--query",
            "SELECT nope FROM nowhere",
        ])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(err(&bad).contains("nowhere"), "{}", err(&bad));
}

/// `--postgres` with nothing to read from it (no --query, --table, --against-query or
/// --against-table) is a usage error; it used to be ignored, stdin audited instead, and even
/// an unreachable URL accepted. A URL from DEDUPGATE_AUDIT_POSTGRES is only a default.
#[test]
fn postgres_without_query_or_table_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "a.jsonl", "{\"id\":1}\n");
    let url = "postgres://x@127.0.0.1:1/none";
    let o = dg()
        .env_remove("DEDUPGATE_AUDIT_POSTGRES")
        .args(["audit", "--key-fields", "id", "--postgres", url])
        .stdin(fs::File::open(&file).unwrap())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", err(&o));
    assert!(err(&o).contains("--query"), "{}", err(&o));
    assert!(out(&o).is_empty(), "no report: {}", out(&o));
    let o = dg()
        .env("DEDUPGATE_AUDIT_POSTGRES", url)
        .args(["audit", "--key-fields", "id"])
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
}

/// `--rejects` naming an input or the source is refused before it is truncated.
#[test]
fn rejects_over_an_input_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = "{\"id\":1}\n{\"x\":2}\n";
    let dest = write(dir.path(), "dest.jsonl", text);
    let source = write(dir.path(), "src.jsonl", text);
    for (input, against) in [(&dest, None), (&dest, Some(&source))] {
        for target in [&dest, &source] {
            if against.is_none() && target == &source {
                continue;
            }
            let mut c = dg();
            c.args(["audit", "--key-fields", "id", "--rejects"])
                .arg(target)
                .arg(input);
            if let Some(a) = against {
                c.arg("--against").arg(a);
            }
            let o = c.output().unwrap();
            assert_eq!(o.status.code(), Some(2), "{}", err(&o));
            assert!(err(&o).contains("is the input"), "{}", err(&o));
            assert_eq!(fs::read_to_string(target).unwrap(), text);
        }
    }
}

#[test]
fn reconciling_lists_the_keys_missing_from_the_destination() {
    let dir = tempfile::tempdir().unwrap();
    // Orders 1..=12 at the source, only 1 and 2 in the destination: 10 missing.
    let spec: Vec<(u32, u32)> = (1..=12).map(|o| (o, 0)).collect();
    let source = write(dir.path(), "src.jsonl", &rows(&spec));
    let dest = write(dir.path(), "dst.jsonl", &rows(&spec[..2]));
    let audit = |extra: &[&str]| {
        dg().args(["audit", "--key-fields", "order"])
            .args(extra)
            .arg("--against")
            .arg(&source)
            .arg(&dest)
            .output()
            .unwrap()
    };
    let o = audit(&["--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", err(&o));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(v["against"]["keys_missing_from_destination"], 10);
    let missing: Vec<String> = v["against"]["keys_missing"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            assert_eq!(m["source"], 1);
            m["key"].as_str().unwrap().to_owned()
        })
        .collect();
    let mut expected: Vec<String> = (3..=12).map(|o| format!("{{\"order\": {o}}}")).collect();
    expected.sort();
    assert_eq!(missing, expected, "every missing key, by key");
    // The table lists --top of them and counts the rest.
    let o = audit(&["--top", "4"]);
    let table = out(&o);
    assert!(table.contains("missing from the destination"), "{table}");
    let listed = expected
        .iter()
        .filter(|k| table.contains(k.as_str()))
        .count();
    assert_eq!(listed, 4, "{table}");
    assert!(table.contains("and 6 more"), "{table}");
}

#[test]
fn windows_without_a_source_are_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let dest = write(dir.path(), "dst.jsonl", &rows(&[(1, 0), (1, 0)]));
    let o = dg()
        .args([
            "audit",
            "--key-fields",
            "order",
            "--window-field",
            "ts",
            "--window",
            "1h",
        ])
        .arg(&dest)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", out(&o));
    assert!(err(&o).contains("--against"), "{}", err(&o));
}
