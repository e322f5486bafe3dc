//! `dedupgate relay`: a thin adapter over dedupgate-relay. Flags (one route) or a TOML file
//! (`--config`, several `[[route]]`s) become checked routes; each route's STORE is opened once
//! (routes naming the same STORE share it: an embedded directory can be opened only once);
//! then the relay runs until SIGINT or SIGTERM and lets the deliveries in hand settle.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use dedupgate_core::{Gate, Store};
use dedupgate_relay::{RelayConfig, RouteConfig};
use dedupgate_stores::{self as store_spec, StoreSpec};

/// Flags of `dedupgate relay`.
#[derive(clap::Args, Debug)]
pub struct RelayArgs {
    /// The source: kafka://HOST:PORT/TOPIC?group=G, amqp://USER:PASS@HOST:PORT/VHOST?queue=Q,
    /// nats://HOST:PORT/STREAM?consumer=C.
    #[arg(long, value_name = "SOURCE", required_unless_present = "config")]
    from: Option<String>,
    /// The sink: kafka://HOST:PORT/TOPIC (from a Kafka source, ?transactional=ID: records and
    /// consumed offsets in one transaction), amqp://…/VHOST?exchange=X&routing_key=K,
    /// nats://HOST:PORT/SUBJECT, http(s)://HOST:PORT/PATH (webhook),
    /// postgres://USER@HOST:PORT/DB?table=T (upsert), stdout:, file:PATH.
    #[arg(long, value_name = "SINK", required_unless_present = "config")]
    to: Option<String>,
    /// Key template over the JSON payload ({order.id}, {ts|window:5m}) [default: the source's
    /// message id: Kafka header idempotency-key, AMQP message_id, NATS Nats-Msg-Id].
    #[arg(long, value_name = "TEMPLATE")]
    key: Option<String>,
    /// retriable: claim, forward, complete (a failed forward is retried); idempotent: mark,
    /// then forward (at most once) [default: retriable].
    #[arg(long, value_parser = ["retriable", "idempotent"])]
    mode: Option<String>,
    /// Where keys live: a path or embedded:PATH, memory:, redis://…, postgres://…
    /// [default: ./dedupgate-data].
    #[arg(long, env = "DEDUPGATE_STORE")]
    store: Option<String>,
    /// Gate namespace [default: relay.<route name>].
    #[arg(long)]
    namespace: Option<String>,
    /// How long a key is remembered (30s, 24h, 7d) [default: 24h].
    #[arg(long)]
    ttl: Option<String>,
    /// Where rejected messages go, with the reason in headers: a sink URL (a Kafka source:
    /// kafka://SAME-CLUSTER/TOPIC).
    #[arg(long, value_name = "SINK")]
    dead_letter: Option<String>,
    /// Dead-letter a message whose forward failed on this many deliveries.
    #[arg(long, value_name = "N")]
    max_attempts: Option<u32>,
    /// Route name: the metrics label [default: route-1].
    #[arg(long)]
    name: Option<String>,
    /// TOML file of [[route]] tables (and metrics_listen) instead of the route flags.
    #[arg(long, conflicts_with_all = ["from", "to", "key", "mode", "namespace", "ttl", "dead_letter", "max_attempts", "name"])]
    config: Option<PathBuf>,
    /// Serve Prometheus /metrics on this address, e.g. 127.0.0.1:9464 [default: off].
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
}

/// Runs `dedupgate relay` until SIGTERM or SIGINT.
pub fn run(args: RelayArgs) -> anyhow::Result<ExitCode> {
    let (mut raw, file_metrics) = match &args.config {
        Some(path) => {
            let file = RelayConfig::load(path)?;
            (file.routes, file.metrics_listen)
        }
        None => (
            vec![RouteConfig {
                name: args.name,
                // clap requires both without --config.
                from: args.from.unwrap_or_default(),
                to: args.to.unwrap_or_default(),
                key: args.key,
                mode: args.mode,
                store: None,
                namespace: args.namespace,
                ttl: args.ttl,
                dead_letter: args.dead_letter,
                max_attempts: args.max_attempts,
            }],
            None,
        ),
    };
    // --store (or DEDUPGATE_STORE) is the store of every route that names none.
    for route in &mut raw {
        if route.store.is_none() {
            route.store.clone_from(&args.store);
        }
    }
    let routes = RelayConfig::check_routes(raw)?;
    let metrics_listen = args.metrics_listen.or(file_metrics);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let mut stores: BTreeMap<String, Arc<dyn Store>> = BTreeMap::new();
        let mut with_gates = Vec::with_capacity(routes.len());
        for route in routes {
            let spec: StoreSpec = match &route.store {
                Some(s) => s
                    .parse()
                    .with_context(|| format!("route {:?}: --store", route.name))?,
                None => StoreSpec::default(),
            };
            // Keyed by the STORE as written: two routes writing it alike share one store.
            let id = route.store.clone().unwrap_or_default();
            let store = match stores.get(&id) {
                Some(store) => store.clone(),
                None => {
                    let store = store_spec::open(&spec)
                        .await
                        .map_err(|e| super::pipeline::backend::serving_open_failed(e, "relay"))?;
                    stores.insert(id, store.clone());
                    store
                }
            };
            with_gates.push((route, Gate::from_arc(store)));
        }
        let metrics = dedupgate_relay::run(
            with_gates,
            metrics_listen.as_deref(),
            super::shutdown_signal(),
        )
        .await?;
        tracing::info!("relay stopped: the deliveries in hand settled");
        drop(metrics);
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}
