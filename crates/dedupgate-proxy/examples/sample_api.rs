//! The sample API on its own, to put the proxy in front of (README, scripts/bench-proxy.sh).
//!
//! `cargo run -p dedupgate-proxy --features sample --example sample_api -- 127.0.0.1:3000`

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    let api = dedupgate_proxy::sample::SampleApi::spawn(listener)?;
    eprintln!("sample API listening on {}", api.url());
    let _ = tokio::signal::ctrl_c().await;
    eprintln!("sample API ran {} requests", api.counts.total());
    Ok(())
}
