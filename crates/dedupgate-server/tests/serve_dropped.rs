//! `serve` dropped (its task aborted) instead of shut down: its open keep-alive connections
//! still end, so they let go of the state and with it the store (for the embedded store, the
//! directory lock a restart needs).

use std::sync::Arc;
use std::time::Duration;

use dedupgate_core::MemoryStore;
use dedupgate_server::{serve, AppState, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[tokio::test]
async fn an_aborted_serve_closes_its_keep_alive_connections_and_releases_the_state() {
    let state = AppState::new(Arc::new(MemoryStore::new()), ServerConfig::default());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(serve(listener, state.clone(), std::future::pending()));

    // One keep-alive request, answered; the connection stays open afterwards.
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    let body = r#"{"namespace":"n","key":"k"}"#;
    let request = format!(
        "POST /v1/claim HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tcp.read(&mut buf).await.unwrap();
    assert!(
        String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
    assert!(
        Arc::strong_count(&state) > 1,
        "the connection holds the state"
    );

    server.abort();
    let _ = server.await;

    // The idle connection is closed by the server (EOF), not left open forever.
    let read = tokio::time::timeout(Duration::from_secs(10), tcp.read(&mut buf))
        .await
        .expect("the connection was left open after serve was dropped");
    assert_eq!(read.unwrap_or(0), 0, "EOF expected");
    // And every clone of the state is gone again.
    for _ in 0..100 {
        if Arc::strong_count(&state) == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the state is still held: {}", Arc::strong_count(&state));
}
