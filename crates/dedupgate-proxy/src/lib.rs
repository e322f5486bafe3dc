//! # dedupgate-proxy
//!
//! Stripe-style Idempotency-Key semantics (and the IETF draft "The Idempotency-Key HTTP Header
//! Field") for any HTTP API, over any dedupgate [`Store`](dedupgate_core::Store):
//!
//! - [`IdempotencyLayer`] / [`IdempotencyService`]: a tower layer. It reads the key, scopes it
//!   to the caller, method and path ([`key`]), fingerprints the request, and turns the core's
//!   claim answer into a response: forward once and store the final response
//!   ([`StoredResponse`], optionally sealed by a [`Sealer`]), replay it with
//!   `Idempotent-Replayed: true`, 409 while in flight, 422 on another payload. It never decides
//!   anything itself: every decision is a `Claim`/`Complete`/`Release`/`Extend` of the core.
//! - [`ProxyServer`]: the reverse proxy, that layer around [`Upstream`] (a pooled hyper client
//!   with rustls), behind a [`FramingGuard`](guard::FramingGuard) that refuses smuggling.
//! - [`IdempotencyConfig`] and [`ConfigFile`]: per-route rules (methods, path patterns,
//!   required/optional, the [`ErrorFormat`] of the proxy's own errors: problem JSON or
//!   Stripe's), limits and header policy, from code or TOML.
//! - [`ProxyBody`]: the proxy's body type (streaming or buffered).
//! - `sample` (feature): a sample API that counts executions, for tests, examples and benchmarks.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use dedupgate_proxy::{ProxyConfig, ProxyServer, UpstreamConfig};
//! let store = Arc::new(dedupgate_core::MemoryStore::new());
//! let config = ProxyConfig::new("127.0.0.1:7879".parse()?, UpstreamConfig::new("http://127.0.0.1:3000"));
//! let server = ProxyServer::bind(config, store).await?;
//! server.run(async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! # Ok(()) }
//! ```

pub mod body;
pub mod config;
pub mod error;
pub mod forward;
pub mod guard;
pub mod headers;
pub mod key;
pub mod layer;
pub mod problem;
#[cfg(feature = "sample")]
pub mod sample;
pub mod seal;
pub mod server;
pub mod stored;

/// The boxed error of bodies and services.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub use http;

pub use body::ProxyBody;
pub use config::{parse_duration_ms, ConfigFile, IdempotencyConfig, Requirement, Route};
pub use error::{ConfigError, ServeError, StoredError};
pub use forward::{ClientAddr, Upstream, UpstreamConfig};
pub use layer::{IdempotencyLayer, IdempotencyService};
pub use problem::ErrorFormat;
pub use seal::Sealer;
pub use server::{ProxyConfig, ProxyServer};
pub use stored::StoredResponse;
