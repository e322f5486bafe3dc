//! What the relay's integration tests share: the workload's shape (M messages, D of them
//! copies of earlier keys), unique names, and reading the relay's `/metrics`.

#![allow(dead_code)] // each test binary uses part of it

/// Messages published per test, and how many of them copy an earlier key (25%).
pub const M: usize = 200;
pub const D: usize = 50;

/// The key of message `i`: the first M − D are distinct, the rest repeat earlier ones.
pub fn key_of(i: usize) -> String {
    let distinct = M - D;
    format!("k-{}", if i < distinct { i } else { (i * 7) % distinct })
}

/// A name no other run shares: `prefix-<pid>-<nanoseconds>`.
pub fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

/// A free local port for `/metrics`.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET /metrics` on the relay's metrics port; empty while nothing listens there yet.
pub async fn scrape(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return String::new();
    };
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).await.unwrap();
    text
}

/// A route's counter in a scrape (`None` when absent).
pub fn counter(text: &str, noun: &str, route: &str) -> Option<u64> {
    let prefix = format!("dedupgate_relay_{noun}_total{{route=\"{route}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.parse().ok())
}
