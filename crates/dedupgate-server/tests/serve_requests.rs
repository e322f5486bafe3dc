//! Requests against a real `serve` on a free port, over raw HTTP/1.1: record queries are decoded
//! exactly or refused; bodies over the limit are refused from their `Content-Length` alone; a
//! body that never arrives is a 4xx that says nothing was decided; and clients still sending
//! their bodies hold no in-flight slot.

use std::net::SocketAddr;
use std::sync::Arc;

use dedupgate_core::MemoryStore;
use dedupgate_server::{serve, AppState, Limits, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

async fn start(limits: Limits) -> SocketAddr {
    let config = ServerConfig {
        limits: limits.validated().unwrap(),
        ..ServerConfig::default()
    };
    let state = AppState::new(Arc::new(MemoryStore::new()), config);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve(listener, state, std::future::pending()));
    addr
}

/// Reads one answer (head and `Content-Length` body) from `tcp`.
async fn answer(tcp: &mut TcpStream) -> (u16, String) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&buf).into_owned();
        if let Some(end) = text.find("\r\n\r\n") {
            let head = text[..end].to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length: "))
                .map_or(0, |v| v.trim().parse::<usize>().unwrap());
            if buf.len() >= end + 4 + length {
                let status = text[9..12].parse().unwrap();
                return (status, text[end + 4..end + 4 + length].to_owned());
            }
        }
        let n = tcp.read(&mut chunk).await.unwrap();
        assert!(n > 0, "connection closed before a whole answer: {text:?}");
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn request(addr: SocketAddr, method: &str, target: &str, body: &str) -> (u16, String) {
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "{method} {target} HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    answer(&mut tcp).await
}

fn code(body: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(body).unwrap();
    v["code"].as_str().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn a_query_that_is_not_utf8_is_refused_and_names_no_other_record() {
    let addr = start(Limits::default()).await;
    let (status, body) = request(
        addr,
        "POST",
        "/v1/mark",
        r#"{"namespace":"t4","key":"\ufffd","result":1}"#,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    for (method, target) in [
        ("GET", "/v1/record?namespace=t4&key=%FF"),
        ("DELETE", "/v1/record?namespace=t4&key=%FE"),
        ("GET", "/v1/record?namespace=%C3&key=x"),
    ] {
        let (status, body) = request(addr, method, target, "").await;
        assert_eq!(status, 400, "{method} {target}: {body}");
        assert_eq!(code(&body), "invalid_request", "{body}");
    }
    // The record is still there, under its real key (U+FFFD is EF BF BD in UTF-8).
    let (status, body) = request(addr, "GET", "/v1/record?namespace=t4&key=%EF%BF%BD", "").await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(r#""result":1"#), "{body}");
}

#[tokio::test]
async fn a_body_announced_over_the_limit_is_413_without_being_read() {
    // Without the early check the server would wait for the body and answer 503 after this.
    let addr = start(Limits {
        body_bytes_max: 1024,
        request_timeout_ms: 2_000,
        ..Limits::default()
    })
    .await;
    for route in ["/v1/claim", "/v1/batch"] {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let head =
            format!("POST {route} HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999999\r\n\r\n");
        tcp.write_all(head.as_bytes()).await.unwrap();
        let (status, body) = answer(&mut tcp).await;
        assert_eq!(status, 413, "{route}: {body}");
        assert_eq!(code(&body), "payload_too_large", "{body}");
    }
}

#[tokio::test]
async fn a_body_that_never_arrives_is_a_4xx_that_decided_nothing() {
    let addr = start(Limits {
        request_timeout_ms: 300,
        ..Limits::default()
    })
    .await;
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"POST /v1/claim HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"")
        .await
        .unwrap();
    let (status, body) = answer(&mut tcp).await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(code(&body), "invalid_request", "{body}");
    assert!(
        body.contains("did not arrive") && !body.contains("may"),
        "{body}"
    );
}

#[tokio::test]
async fn clients_still_sending_their_bodies_hold_no_in_flight_slot() {
    let addr = start(Limits {
        in_flight_max: 2,
        request_timeout_ms: 600_000,
        ..Limits::default()
    })
    .await;
    let body = r#"{"namespace":"slow","key":"k1"}"#;
    // Two clients send only their heads. `Expect: 100-continue` makes the server say when it
    // starts reading a body, so both are known to be past routing before the third request.
    let mut slow = Vec::new();
    for _ in 0..2 {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /v1/claim HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        tcp.write_all(head.as_bytes()).await.unwrap();
        let mut buf = [0u8; 64];
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(
            buf[..n].starts_with(b"HTTP/1.1 100"),
            "{:?}",
            String::from_utf8_lossy(&buf[..n])
        );
        slow.push(tcp);
    }
    for i in 0..3 {
        let (status, answer) = request(
            addr,
            "POST",
            "/v1/claim",
            &format!(r#"{{"namespace":"fast","key":"k{i}"}}"#),
        )
        .await;
        assert_eq!(status, 200, "{answer}");
    }
    // The slow ones are answered once their bodies arrive.
    for (i, mut tcp) in slow.into_iter().enumerate() {
        let body = format!(r#"{{"namespace":"slow","key":"k{i}"}}"#);
        tcp.write_all(body.as_bytes()).await.unwrap();
        let (status, answer) = answer(&mut tcp).await;
        assert_eq!(status, 200, "{answer}");
    }
}

/// Found by review: bodies are read before a request takes an in-flight slot, so the slots no
/// longer bounded the memory of bodies being received. At most `BODIES_RECEIVED_AT_ONCE` bodies
/// of the largest size are held at once; past that a request is answered 503 (nothing decided),
/// and the budget comes back as the slow bodies finish.
#[tokio::test]
async fn bodies_being_received_are_bounded_in_bytes() {
    const LIMIT: usize = 1024;
    let addr = start(Limits {
        body_bytes_max: LIMIT,
        request_timeout_ms: 600_000,
        ..Limits::default()
    })
    .await;
    // A claim padded with spaces (valid JSON) to `LIMIT` bytes.
    let padded = |key: &str| {
        let mut body = format!(r#"{{"namespace":"big","key":"{key}"}}"#);
        body.push_str(&" ".repeat(LIMIT - body.len()));
        body
    };
    // Enough slow senders to hold the whole budget with all but the last 10 bytes of each body.
    let mut slow = Vec::new();
    for i in 0..dedupgate_server::BODIES_RECEIVED_AT_ONCE {
        let body = padded(&format!("slow{i}"));
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let head = format!("POST /v1/claim HTTP/1.1\r\nhost: x\r\ncontent-length: {LIMIT}\r\n\r\n");
        tcp.write_all(head.as_bytes()).await.unwrap();
        tcp.write_all(&body.as_bytes()[..LIMIT - 10]).await.unwrap();
        slow.push((tcp, body));
    }
    // The server reads the slow bodies as they arrive; once it has, a further body is refused.
    let mut refused = None;
    for attempt in 0..200 {
        let (status, answer) = request(
            addr,
            "POST",
            "/v1/claim",
            &padded(&format!("more{attempt}")),
        )
        .await;
        if status == 503 {
            refused = Some(answer);
            break;
        }
        assert_eq!(status, 200, "{answer}");
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    let refused = refused.expect("a body past the budget is refused");
    assert_eq!(code(&refused), "unavailable");
    // The slow bodies finish; each is decided, and the budget is free again.
    for (mut tcp, body) in slow {
        tcp.write_all(&body.as_bytes()[LIMIT - 10..]).await.unwrap();
        let (status, answer) = answer(&mut tcp).await;
        assert_eq!(status, 200, "{answer}");
    }
    let (status, answer) = request(addr, "POST", "/v1/claim", &padded("after")).await;
    assert_eq!(status, 200, "{answer}");
}

/// Found by schemathesis: a route that takes no body (a wrong method, an unknown path, a
/// record query, a probe) answered without reading the body sent with it, and hyper then
/// closed the connection without saying so; a client that sent its next request on it (as
/// keep-alive allows) saw the connection drop with no answer. The body is read and dropped
/// now, and the connection stays usable.
#[tokio::test]
async fn a_body_sent_to_a_route_that_takes_none_leaves_the_connection_usable() {
    let addr = start(Limits::default()).await;
    let body = r#"{"namespace":"n","key":"k","token":"t","lease_ms":1}"#;
    for (method, target, status) in [
        ("PUT", "/v1/extend", 405),
        ("POST", "/v1/nowhere", 404),
        ("GET", "/v1/record?namespace=n&key=k", 404),
        ("DELETE", "/v1/record?namespace=n&key=k", 200),
        ("GET", "/healthz", 200),
        ("GET", "/metrics", 200),
    ] {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "{method} {target} HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        tcp.write_all(head.as_bytes()).await.unwrap();
        // The body comes a moment after the head, as from a client that writes them apart.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        tcp.write_all(body.as_bytes()).await.unwrap();
        let (got, text) = answer(&mut tcp).await;
        assert_eq!(got, status, "{method} {target}: {text}");
        tcp.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let (got, text) = answer(&mut tcp).await;
        assert_eq!(got, 200, "{method} {target}, then /healthz: {text}");
    }
}

/// A client that sent `Expect: 100-continue` to a route that takes no body was asked for its
/// body (reading it made hyper send `100 Continue`), and uploaded up to `body_bytes_max` that a
/// 404 or a probe never needs. It is not asked now: the answer comes at once, without a
/// `100 Continue`, and closes the connection (the body it holds back is never read).
#[tokio::test]
async fn a_body_held_back_for_100_continue_is_not_asked_for_by_a_route_that_takes_none() {
    let addr = start(Limits {
        request_timeout_ms: 2_000,
        ..Limits::default()
    })
    .await;
    for (method, target, status) in [
        ("PUT", "/v1/extend", "405"),
        ("POST", "/v1/nowhere", "404"),
        ("GET", "/v1/record?namespace=n&key=k", "404"),
        ("GET", "/healthz", "200"),
        ("GET", "/metrics", "200"),
    ] {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "{method} {target} HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n\
             content-length: 1000000\r\n\r\n"
        );
        tcp.write_all(head.as_bytes()).await.unwrap();
        // Everything the server sends until it closes the connection, the body never sent.
        let mut got = Vec::new();
        let read = tokio::time::timeout(
            std::time::Duration::from_millis(1_000),
            tcp.read_to_end(&mut got),
        )
        .await;
        let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
        assert!(
            !text.contains(" 100 continue"),
            "{method} {target} asked for the body: {text:?}"
        );
        assert!(
            read.is_ok(),
            "{method} {target}: no closed answer within 1 s: {text:?}"
        );
        assert!(
            text.starts_with(&format!("http/1.1 {status} ")),
            "{method} {target}: {text:?}"
        );
        let head = &text[..text.find("\r\n\r\n").unwrap()];
        assert!(
            head.lines().any(|l| l == "connection: close"),
            "{method} {target}: {text:?}"
        );
    }
}
