//! Settings `dedupgate serve` cannot honour stop the start with a clear message instead of being
//! quietly changed or half-applied: limits over API.md's caps, token entries that cannot work as
//! written. And an error names its cause once.

use std::path::Path;

use dedupgate_core::model::{KEY_BYTES_MAX, NAMESPACE_BYTES_MAX};
use dedupgate_core::BATCH_OPS_MAX;
use dedupgate_server::{FileConfig, Limits};

#[test]
fn limits_over_the_contract_or_zero_are_refused() {
    for (limits, words) in [
        (
            Limits {
                key_bytes_max: 5000,
                ..Limits::default()
            },
            "key_bytes_max must be at most 1024",
        ),
        (
            Limits {
                namespace_bytes_max: 500,
                ..Limits::default()
            },
            "namespace_bytes_max must be at most 128",
        ),
        (
            Limits {
                batch_ops_max: 20_000,
                ..Limits::default()
            },
            "batch_ops_max must be at most 10000",
        ),
        (
            Limits {
                in_flight_max: 0,
                ..Limits::default()
            },
            "in_flight_max must be positive",
        ),
    ] {
        let message = limits.validated().unwrap_err().to_string();
        assert!(message.contains(words), "{message}");
    }
    let at_the_caps = Limits {
        key_bytes_max: KEY_BYTES_MAX,
        namespace_bytes_max: NAMESPACE_BYTES_MAX,
        batch_ops_max: BATCH_OPS_MAX,
        ..Limits::default()
    };
    assert_eq!(at_the_caps.clone().validated().unwrap(), at_the_caps);
}

#[test]
fn tokens_with_no_namespace_or_a_repeated_secret_are_refused() {
    let empty = FileConfig::parse(
        "[[tokens]]\nname=\"w\"\ntoken=\"0123456789abcdef\"\nnamespaces=[]\nrole=\"client\"",
    )
    .unwrap_err();
    assert!(
        empty.contains("token 1 (w): `namespaces` is empty"),
        "{empty}"
    );
    let twice = FileConfig::parse(
        r#"
        [[tokens]]
        name = "a"
        token = "0123456789abcdef"
        namespaces = ["*"]
        role = "client"
        [[tokens]]
        name = "b"
        token = "0123456789abcdef"
        namespaces = ["*"]
        role = "admin"
        "#,
    )
    .unwrap_err();
    assert!(
        twice.contains("token 2 (b) has the same secret as token 1 (a)"),
        "{twice}"
    );
    assert!(!twice.contains("0123456789abcdef"), "{twice}");
}

#[test]
fn an_unreadable_file_names_its_cause_once() {
    let err = FileConfig::load(Path::new("/nonexistent/dedupgate.toml")).unwrap_err();
    let mut text = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    assert!(
        text.starts_with("cannot read config file /nonexistent/dedupgate.toml: "),
        "{text}"
    );
    assert_eq!(text.matches("os error 2").count(), 1, "{text}");
}
