//! # dedupgate-server
//!
//! The gate as an HTTP service: API.md's `/v1/*` routes over any [`dedupgate_core::Store`].
//! The server never decides anything itself: it parses JSON into a core [`dedupgate_core::Op`]
//! ([`wire`]), calls the store, and renders the [`dedupgate_core::Outcome`] or the
//! [`dedupgate_core::GateError`] as API.md's JSON or [`Problem`] JSON.
//!
//! - [`ServerConfig`] and [`Limits`]: default durations, size/time/concurrency limits, bearer
//!   tokens; [`FileConfig`] is the optional TOML file.
//! - [`AppState`] holds the store, config, [`Auth`] and [`Metrics`]; [`router`] builds the axum
//!   router from [`ROUTES`] (the table the OpenAPI test checks against `docs/openapi.json`).
//! - [`serve`] runs it with HTTP/1.1 + h2c keep-alive, the background sweeper and graceful
//!   shutdown.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use std::sync::Arc;
//! use dedupgate_core::MemoryStore;
//! use dedupgate_server::{serve, AppState, ServerConfig};
//! let state = AppState::new(Arc::new(MemoryStore::new()), ServerConfig::default());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:7878").await?;
//! serve(listener, state, async { let _ = tokio::signal::ctrl_c().await; }).await
//! # }
//! ```

pub mod app;
pub mod auth;
pub mod config;
pub mod metrics;
pub mod problem;
pub mod server;
pub mod wire;

pub use app::{router, AppState, Route, BODIES_RECEIVED_AT_ONCE, ROUTES};
pub use auth::{Auth, Principal};
pub use config::{
    check_metrics_namespaces, check_tokens, parse_duration_ms, ConfigError, FileConfig, Limits,
    Role, ServerConfig, TokenRule,
};
pub use metrics::{Exposition, Metrics};
pub use problem::Problem;
pub use server::serve;
