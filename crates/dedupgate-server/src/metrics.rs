//! Prometheus metrics ([`Metrics`]), one registry per server (no global state, so several servers
//! in one process, as in tests, never mix their figures). Labels are bounded: a namespace gets a
//! label of its own only as [`crate::ServerConfig::metrics_namespaces`] and
//! [`crate::ServerConfig::namespace_labels_max`] allow, the rest are counted as `other`; keys
//! are never labels.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use dedupgate_core::{GateError, Outcome, StoreStats};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::auth::glob_match;

/// The namespace label of every namespace without a label of its own.
pub const OTHER_NAMESPACE: &str = "other";

/// Every `outcome` label of the decisions counter.
const OUTCOMES: [&str; 10] = [
    "new",
    "duplicate_completed",
    "duplicate_in_progress",
    "completed",
    "released",
    "extended",
    "found",
    "forgotten",
    "lease_lost",
    "fingerprint_mismatch",
];

/// Every `route` label of the request histogram (API routes, then `other`).
const ROUTE_LABELS: [&str; 10] = [
    "/v1/claim",
    "/v1/complete",
    "/v1/release",
    "/v1/extend",
    "/v1/mark",
    "/v1/record",
    "/v1/batch",
    "/healthz",
    "/metrics",
    "other",
];

/// Every `op` label of the store histogram.
const OP_LABELS: [&str; 8] = [
    "claim", "complete", "release", "extend", "mark", "get", "forget", "batch",
];

/// Handles of a family's series, looked up once: a series is created on first use (as with
/// `get_or_create`) and then reached without hashing its labels or taking the family's lock.
struct Handles<M, const N: usize>([OnceLock<M>; N]);

impl<M: Clone, const N: usize> Handles<M, N> {
    fn new() -> Self {
        Self(std::array::from_fn(|_| OnceLock::new()))
    }

    fn get(&self, i: usize, create: impl FnOnce() -> M) -> &M {
        self.0[i].get_or_init(create)
    }
}

/// The metrics of one namespace label: its decision counters by outcome.
pub struct NamespaceLabel {
    name: Arc<String>,
    decisions: Handles<Counter, { OUTCOMES.len() }>,
}

impl NamespaceLabel {
    fn new(name: Arc<String>) -> Arc<Self> {
        Arc::new(Self {
            name,
            decisions: Handles::new(),
        })
    }

    /// The label text.
    pub fn as_str(&self) -> &str {
        &self.name
    }
}

impl std::fmt::Debug for NamespaceLabel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NamespaceLabel({:?})", self.name)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    namespace: Arc<String>,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    code: &'static str,
}

fn latency_histogram() -> Histogram {
    // 50 µs .. ~26 s in doublings: covers an in-memory decision and a stalled fsync alike.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 20))
}

/// The server's metrics.
pub struct Metrics {
    registry: Registry,
    decisions: Family<DecisionLabels, Counter>,
    requests: Family<RouteLabels, Histogram, fn() -> Histogram>,
    store_calls: Family<OpLabels, Histogram, fn() -> Histogram>,
    errors: Family<CodeLabels, Counter>,
    in_flight: Gauge,
    records_held: Gauge,
    swept: Counter,
    route_handles: Handles<Histogram, { ROUTE_LABELS.len() }>,
    op_handles: Handles<Histogram, { OP_LABELS.len() }>,
    /// Namespaces with a label of their own: the configured names from the start, then those
    /// let in at run time (by a configured glob, or first come when none is configured).
    namespaces: RwLock<HashMap<String, Arc<NamespaceLabel>>>,
    /// How many of `namespaces` are configured names (the cap bounds the others).
    named: usize,
    /// Configured globs (`*`, `?`); `None` when nothing is configured (first come, first served).
    globs: Option<Vec<String>>,
    namespace_labels_max: usize,
    other: Arc<NamespaceLabel>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    /// A fresh registry with every metric of the service. `labelled` lists the namespaces
    /// (names, or globs with `*` and `?`) that get a label of their own: names always, names a
    /// glob matches while fewer than `namespace_labels_max` have been let in. Empty, the first
    /// `namespace_labels_max` namespaces seen get one. All others count as `other`.
    pub fn new(namespace_labels_max: usize, labelled: &[String]) -> Self {
        let mut registry = Registry::with_prefix("dedupgate");
        let decisions = Family::<DecisionLabels, Counter>::default();
        registry.register(
            "decisions",
            "Decisions by namespace and outcome (new, duplicate_completed, duplicate_in_progress, fingerprint_mismatch, lease_lost, completed, released, extended, found, forgotten)",
            decisions.clone(),
        );
        let requests: Family<RouteLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "request_duration_seconds",
            "HTTP request latency by route, from the first byte read to the answer",
            requests.clone(),
        );
        let store_calls: Family<OpLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "store_duration_seconds",
            "Store call latency by operation (batch for a whole batch)",
            store_calls.clone(),
        );
        let errors = Family::<CodeLabels, Counter>::default();
        registry.register(
            "errors",
            "Error answers by API.md code (batch items included)",
            errors.clone(),
        );
        let in_flight = Gauge::default();
        registry.register(
            "requests_in_flight",
            "API requests being answered now (/healthz and /metrics not counted)",
            in_flight.clone(),
        );
        let records_held = Gauge::default();
        registry.register(
            "records_held",
            "Records the store holds (expired-but-unswept included), read at scrape time",
            records_held.clone(),
        );
        let swept = Counter::default();
        registry.register(
            "records_swept",
            "Expired records removed: the store's own count where it keeps one, else this server's sweeper's",
            swept.clone(),
        );
        let (globs, names): (Vec<&String>, Vec<&String>) =
            labelled.iter().partition(|p| p.contains(['*', '?']));
        let named: HashMap<String, Arc<NamespaceLabel>> = names
            .into_iter()
            .map(|n| (n.clone(), NamespaceLabel::new(Arc::new(n.clone()))))
            .collect();
        let named_count = named.len();
        let globs = (!labelled.is_empty()).then(|| globs.into_iter().cloned().collect());
        Self {
            registry,
            decisions,
            requests,
            store_calls,
            errors,
            in_flight,
            records_held,
            swept,
            route_handles: Handles::new(),
            op_handles: Handles::new(),
            namespaces: RwLock::new(named),
            named: named_count,
            globs,
            namespace_labels_max,
            other: NamespaceLabel::new(Arc::new(OTHER_NAMESPACE.to_owned())),
        }
    }

    /// The label for `namespace`: itself when it is a configured name, or when a configured
    /// glob matches it (with no configuration: any namespace) and fewer than the cap have been
    /// let in that way; else `other`. A namespace let in keeps its label until a restart.
    pub fn namespace_label(&self, namespace: &str) -> Arc<NamespaceLabel> {
        let known = |set: &HashMap<String, Arc<NamespaceLabel>>| {
            set.get(namespace).cloned().or_else(|| {
                (set.len() - self.named >= self.namespace_labels_max).then(|| self.other.clone())
            })
        };
        if let Some(label) = known(&self.namespaces.read().unwrap_or_else(|p| p.into_inner())) {
            return label;
        }
        if let Some(globs) = &self.globs {
            if !globs.iter().any(|g| glob_match(g, namespace)) {
                return self.other.clone();
            }
        }
        let mut set = self.namespaces.write().unwrap_or_else(|p| p.into_inner());
        if let Some(label) = known(&set) {
            return label;
        }
        let label = NamespaceLabel::new(Arc::new(namespace.to_owned()));
        set.insert(namespace.to_owned(), label.clone());
        label
    }

    /// Counts a decision (or a refusal the core decided: lease_lost, fingerprint_mismatch).
    pub fn decision(&self, namespace: &NamespaceLabel, answer: &Result<Outcome, GateError>) {
        let outcome = match answer {
            Ok(o) => o.label(),
            Err(e @ (GateError::LeaseLost | GateError::FingerprintMismatch)) => e.code(),
            Err(_) => return,
        };
        let create = || {
            self.decisions
                .get_or_create(&DecisionLabels {
                    namespace: namespace.name.clone(),
                    outcome,
                })
                .clone()
        };
        match OUTCOMES.iter().position(|o| *o == outcome) {
            Some(i) => namespace.decisions.get(i, create).inc(),
            None => create().inc(),
        };
    }

    /// Counts an error answer.
    pub fn error(&self, code: &'static str) {
        self.errors.get_or_create(&CodeLabels { code }).inc();
    }

    /// Records a request's latency.
    pub fn request(&self, route: &'static str, elapsed: Duration) {
        let create = || self.requests.get_or_create(&RouteLabels { route }).clone();
        let seconds = elapsed.as_secs_f64();
        match ROUTE_LABELS.iter().position(|r| *r == route) {
            Some(i) => self.route_handles.get(i, create).observe(seconds),
            None => create().observe(seconds),
        }
    }

    /// Records a store call's latency.
    pub fn store_call(&self, op: &'static str, elapsed: Duration) {
        let create = || self.store_calls.get_or_create(&OpLabels { op }).clone();
        let seconds = elapsed.as_secs_f64();
        match OP_LABELS.iter().position(|o| *o == op) {
            Some(i) => self.op_handles.get(i, create).observe(seconds),
            None => create().observe(seconds),
        }
    }

    /// The in-flight gauge.
    pub fn in_flight(&self) -> &Gauge {
        &self.in_flight
    }

    /// Counts records removed by the sweeper.
    pub fn swept(&self, n: u64) {
        self.swept.inc_by(n);
    }

    /// Renders the exposition in `format`, taking the store's figures first.
    pub fn render(&self, stats: Option<&StoreStats>, format: Exposition) -> String {
        if let Some(held) = stats.and_then(|s| s.records_held) {
            self.records_held
                .set(i64::try_from(held).unwrap_or(i64::MAX));
        }
        // A store that sweeps on its own (embedded) counts more than our sweeper saw: follow
        // the larger of the two, which keeps the counter monotonic.
        if let Some(total) = stats.and_then(|s| s.swept_total) {
            let seen = self.swept.get();
            if total > seen {
                self.swept.inc_by(total - seen);
            }
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String never fails");
        match format {
            Exposition::OpenMetrics => out,
            Exposition::Prometheus => openmetrics_to_prometheus(&out),
        }
    }
}

/// The two text formats of `/metrics`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exposition {
    /// Prometheus text format 0.0.4: what a scraper gets unless it asks for OpenMetrics.
    Prometheus,
    /// OpenMetrics 1.0 text, ending in `# EOF`.
    OpenMetrics,
}

impl Exposition {
    /// Chooses by the scraper's `Accept` header, as the official client libraries do:
    /// OpenMetrics when `application/openmetrics-text` is acceptable and no text/plain (or
    /// wildcard) entry is preferred to it (a higher `q`, or the same `q` listed first); the
    /// Prometheus format otherwise, and without the header.
    pub fn negotiate(accept: Option<&[u8]>) -> Self {
        let Some(accept) = accept.and_then(|a| std::str::from_utf8(a).ok()) else {
            return Exposition::Prometheus;
        };
        // (q, is OpenMetrics) of the best entry so far; the first of equal q wins.
        let mut best: Option<(f32, bool)> = None;
        for entry in accept.split(',') {
            let mut parts = entry.split(';');
            let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
            let openmetrics = match media.as_str() {
                "application/openmetrics-text" => true,
                "text/plain" | "text/*" | "*/*" => false,
                _ => continue,
            };
            let q = parts
                .filter_map(|p| p.split_once('='))
                .find(|(name, _)| name.trim().eq_ignore_ascii_case("q"))
                .map_or(1.0, |(_, v)| v.trim().parse::<f32>().unwrap_or(0.0));
            if q > 0.0 && best.is_none_or(|(best_q, _)| q > best_q) {
                best = Some((q, openmetrics));
            }
        }
        match best {
            Some((_, true)) => Exposition::OpenMetrics,
            _ => Exposition::Prometheus,
        }
    }

    /// The `Content-Type` of an answer in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Exposition::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
            Exposition::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// Prometheus text format 0.0.4 from prometheus-client's OpenMetrics text (the crate writes no
/// other format). The two differ, for what this registry holds, only in that a counter's HELP
/// and TYPE lines name its samples (`_total`) rather than the family, and in OpenMetrics' own
/// `# UNIT` and `# EOF` lines, which are dropped. Sample lines are the same in both.
fn openmetrics_to_prometheus(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 256);
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or("");
            let counter = lines
                .peek()
                .is_some_and(|next| *next == format!("# TYPE {name} counter"));
            if counter {
                out.push_str("# HELP ");
                out.push_str(name);
                out.push_str("_total");
                out.push_str(&rest[name.len()..]);
                out.push('\n');
                lines.next();
                out.push_str("# TYPE ");
                out.push_str(name);
                out.push_str("_total counter\n");
                continue;
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_labels_are_capped() {
        let m = Metrics::new(2, &[]);
        assert_eq!(m.namespace_label("a").as_str(), "a");
        assert_eq!(m.namespace_label("b").as_str(), "b");
        assert_eq!(m.namespace_label("c").as_str(), OTHER_NAMESPACE);
        assert_eq!(m.namespace_label("a").as_str(), "a");
        m.decision(&m.namespace_label("zzz"), &Err(GateError::LeaseLost));
        m.decision(&m.namespace_label("a"), &Ok(Outcome::Released));
        m.decision(&m.namespace_label("a"), &Ok(Outcome::Released));
        m.request("/v1/claim", Duration::from_millis(1));
        m.request("/v1/claim", Duration::from_millis(1));
        let text = m.render(None, Exposition::OpenMetrics);
        assert!(
            text.contains(r#"dedupgate_decisions_total{namespace="a",outcome="released"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"dedupgate_request_duration_seconds_count{route="/v1/claim"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"dedupgate_decisions_total{namespace="other",outcome="lease_lost"} 1"#),
            "{text}"
        );
    }

    #[test]
    fn the_format_follows_the_accept_header() {
        use Exposition::*;
        for (accept, want) in [
            (None, Prometheus),
            (Some("*/*"), Prometheus),
            (Some("text/plain"), Prometheus),
            (Some("text/plain;version=0.0.4;q=1,*/*;q=0.1"), Prometheus),
            (Some("application/json"), Prometheus),
            (Some("application/openmetrics-text; q=0"), Prometheus),
            (Some("text/plain, application/openmetrics-text"), Prometheus),
            (
                Some("text/plain;q=0.5, application/openmetrics-text;q=0.9"),
                OpenMetrics,
            ),
            (Some("application/openmetrics-text"), OpenMetrics),
            (
                Some("Application/OpenMetrics-Text; version=1.0.0"),
                OpenMetrics,
            ),
            // What Prometheus 2.x and 3.x send.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                     version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                OpenMetrics,
            ),
        ] {
            assert_eq!(
                Exposition::negotiate(accept.map(str::as_bytes)),
                want,
                "{accept:?}"
            );
        }
    }

    #[test]
    fn the_prometheus_format_names_counters_by_their_samples() {
        let m = Metrics::new(10, &[]);
        m.decision(&m.namespace_label("a"), &Ok(Outcome::Released));
        m.error("invalid_request");
        m.request("/v1/claim", Duration::from_millis(1));
        let om = m.render(None, Exposition::OpenMetrics);
        assert!(om.ends_with("# EOF\n"), "{om}");
        assert!(om.contains("# TYPE dedupgate_decisions counter\n"), "{om}");
        let text = m.render(None, Exposition::Prometheus);
        assert!(!text.contains("# EOF"), "{text}");
        for counter in ["decisions", "errors", "records_swept"] {
            assert!(
                text.contains(&format!("# TYPE dedupgate_{counter}_total counter\n")),
                "{text}"
            );
            assert!(
                text.contains(&format!("# HELP dedupgate_{counter}_total ")),
                "{text}"
            );
        }
        assert!(text.contains("# TYPE dedupgate_request_duration_seconds histogram\n"));
        assert!(text.contains(r#"dedupgate_decisions_total{namespace="a",outcome="released"} 1"#));
        // The samples are the same lines in both.
        let samples = |t: &str| -> Vec<String> {
            t.lines()
                .filter(|l| !l.starts_with('#'))
                .map(String::from)
                .collect()
        };
        assert_eq!(samples(&om), samples(&text));
    }

    #[test]
    fn junk_namespaces_never_push_out_configured_ones() {
        let labelled = ["payments".to_owned(), "orders-*".to_owned()];
        let m = Metrics::new(2, &labelled);
        for i in 0..5_000 {
            assert_eq!(
                m.namespace_label(&format!("junk{i}")).as_str(),
                OTHER_NAMESPACE
            );
        }
        assert_eq!(m.namespace_label("payments").as_str(), "payments");
        // Globs let names in up to the cap; names listed as they are never count against it.
        assert_eq!(m.namespace_label("orders-eu").as_str(), "orders-eu");
        assert_eq!(m.namespace_label("orders-us").as_str(), "orders-us");
        assert_eq!(m.namespace_label("orders-junk").as_str(), OTHER_NAMESPACE);
        assert_eq!(m.namespace_label("orders-eu").as_str(), "orders-eu");
        assert_eq!(m.namespace_label("payments").as_str(), "payments");
        assert_eq!(m.namespace_label("payment").as_str(), OTHER_NAMESPACE);
        // Names alone: nothing else is ever labelled, whatever the cap.
        let m = Metrics::new(1_000, &["payments".to_owned()]);
        assert_eq!(m.namespace_label("junk").as_str(), OTHER_NAMESPACE);
        assert_eq!(m.namespace_label("payments").as_str(), "payments");
    }
}
