//! The relay's settings: [`RouteConfig`], one route as flags or a `[[route]]` table give it
//! (strings, unchecked), checked into a [`Route`]; and [`RelayConfig`], a TOML file of several
//! routes and the metrics address.
//!
//! ```toml
//! metrics_listen = "127.0.0.1:9464"
//!
//! [[route]]
//! name = "orders"
//! from = "kafka://127.0.0.1:9092/orders?group=relay"
//! to = "file:/var/lib/relay/orders.jsonl"
//! key = "{order_id}"
//! mode = "retriable"
//! store = "embedded:/var/lib/relay/gate"
//! ttl = "7d"
//! dead_letter = "kafka://127.0.0.1:9092/orders.dlq"
//! max_attempts = 5
//! ```

use std::path::Path;
use std::time::Duration;

use dedupgate_core::keys::KeyTemplate;
use dedupgate_core::{parse_duration_ms, Mode, Namespace};
use serde::Deserialize;

use crate::route::{Route, SinkSpec, SourceSpec};

/// Why a route or the relay's file is not usable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A source or sink URL does not parse.
    #[error("{url:?}: {reason}")]
    Url {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A route's setting is out of bounds or does not parse.
    #[error("route {route:?}: {field}: {reason}")]
    Field {
        /// The route's name.
        route: String,
        /// The setting.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The file cannot be read or is not TOML of the relay's form.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The file is not TOML of the relay's form; `line` and `column` (from 1) say where.
    #[error("{path}:{line}:{column}: {message}")]
    Toml {
        /// The file.
        path: String,
        /// The line of the error.
        line: usize,
        /// The column (in characters) of the error.
        column: usize,
        /// What is wrong there.
        message: String,
    },
    /// No route at all, or two with one name.
    #[error("{0}")]
    Routes(String),
}

/// One route as given: every field a string or number, checked by [`RouteConfig::check`].
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The route's name (default `route-N`, N from 1).
    pub name: Option<String>,
    /// The source URL.
    pub from: String,
    /// The sink URL.
    pub to: String,
    /// The key template; absent: the source's message id.
    pub key: Option<String>,
    /// `retriable` (default) or `idempotent`.
    pub mode: Option<String>,
    /// The STORE (the binary's forms).
    pub store: Option<String>,
    /// The gate namespace (default `relay.<name>`).
    pub namespace: Option<String>,
    /// How long keys are remembered (`30s`, `24h`, `7d`).
    pub ttl: Option<String>,
    /// The dead-letter sink URL.
    pub dead_letter: Option<String>,
    /// Deliveries of a failing forward before it is dead-lettered.
    pub max_attempts: Option<u32>,
}

impl RouteConfig {
    /// Checks every field; `index` (from 0) names an unnamed route.
    pub fn check(self, index: usize) -> Result<Route, ConfigError> {
        let name = self.name.unwrap_or_else(|| format!("route-{}", index + 1));
        let field = |field: &'static str, reason: String| ConfigError::Field {
            route: name.clone(),
            field,
            reason,
        };
        if name.is_empty() || name.len() > 64 {
            return Err(field("name", "must be 1 to 64 bytes".into()));
        }
        let source: SourceSpec = self.from.parse()?;
        let sink: SinkSpec = self.to.parse()?;
        let key = self
            .key
            .map(|t| KeyTemplate::parse(&t).map_err(|e| field("key", e.to_string())))
            .transpose()?;
        let mode = match self.mode.as_deref() {
            None | Some("retriable") => Mode::Retriable,
            Some("idempotent") => Mode::Idempotent,
            Some(other) => {
                return Err(field(
                    "mode",
                    format!("{other:?} is not retriable or idempotent"),
                ))
            }
        };
        let namespace = self.namespace.unwrap_or_else(|| format!("relay.{name}"));
        Namespace::new(&namespace).map_err(|e| field("namespace", e.reason))?;
        let ttl = self
            .ttl
            .map(|t| {
                parse_duration_ms(&t)
                    .map(Duration::from_millis)
                    .map_err(|e| field("ttl", e.to_string()))
            })
            .transpose()?;
        let dead_letter = self.dead_letter.map(|d| d.parse()).transpose()?;
        if self.max_attempts == Some(0) {
            return Err(field("max_attempts", "must be at least 1".into()));
        }
        if let (SourceSpec::Kafka { bootstrap, .. }, Some(dl)) = (&source, &dead_letter) {
            // The consumer dead-letters through its own producer, to a topic of its cluster.
            if !matches!(dl, SinkSpec::Kafka { bootstrap: b, .. } if b == bootstrap) {
                return Err(field(
                    "dead_letter",
                    format!("a Kafka source's dead letters go to a topic of its own cluster: kafka://{bootstrap}/TOPIC"),
                ));
            }
        }
        if matches!(dead_letter, Some(SinkSpec::Postgres(_))) {
            return Err(field(
                "dead_letter",
                "a PostgreSQL upsert sink takes forwards only: a dead letter has no version to write".into(),
            ));
        }
        check_transactional(&source, &sink, mode, dead_letter.as_ref())
            .map_err(|(name, reason)| field(name, reason))?;
        Ok(Route {
            name,
            source,
            sink,
            key,
            mode,
            store: self.store,
            namespace,
            ttl,
            dead_letter,
            max_attempts: self.max_attempts,
        })
    }
}

/// A `transactional=` sink makes the route one Kafka transaction per batch (consume, gate,
/// produce, commit the consumed offsets): so the source must be a Kafka topic of the same
/// cluster, and the mode retriable (an aborted transaction releases its claims; a mark cannot
/// be released). Dead letters then go into the transaction, so the dead-letter URL takes none.
fn check_transactional(
    source: &SourceSpec,
    sink: &SinkSpec,
    mode: Mode,
    dead_letter: Option<&SinkSpec>,
) -> Result<(), (&'static str, String)> {
    if dead_letter.and_then(SinkSpec::transactional_id).is_some() {
        return Err((
            "dead_letter",
            "transactional= goes on the sink (--to): a transactional route's dead letters are produced in its transaction".into(),
        ));
    }
    let SinkSpec::Kafka {
        bootstrap: sink_cluster,
        transactional_id: Some(_),
        ..
    } = sink
    else {
        return Ok(());
    };
    let source_cluster = match source {
        SourceSpec::Kafka { bootstrap, .. } => bootstrap,
        SourceSpec::Amqp { .. } | SourceSpec::Nats { .. } => {
            let broker = if matches!(source, SourceSpec::Amqp { .. }) {
                "a RabbitMQ ack"
            } else {
                "a JetStream ack"
            };
            return Err((
                "to",
                format!("transactional= needs a Kafka source: no Kafka transaction can cover {broker} (drop transactional= for the idempotent producer)"),
            ));
        }
    };
    if !same_cluster(source_cluster, sink_cluster) {
        return Err((
            "to",
            format!("transactional= needs the sink on the source's cluster (kafka://{source_cluster}/TOPIC): one transaction commits the records and the consumed offsets, and a transaction stays within one cluster"),
        ));
    }
    if mode == Mode::Idempotent {
        return Err((
            "mode",
            "idempotent cannot run with a transactional= sink: a transaction that aborts must release its claims, and a mark cannot be released (use retriable)".into(),
        ));
    }
    Ok(())
}

/// Two bootstrap lists name the same brokers, in any order. (A cluster reached through two
/// different lists is refused too: the relay cannot tell it is one before connecting.)
fn same_cluster(a: &str, b: &str) -> bool {
    let brokers = |list: &str| {
        let mut v: Vec<String> = list.split(',').map(|h| h.trim().to_owned()).collect();
        v.sort();
        v.dedup();
        v
    };
    brokers(a) == brokers(b)
}

/// The relay's file: `metrics_listen` and one `[[route]]` table per route.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    /// Where `/metrics` is served.
    pub metrics_listen: Option<String>,
    /// The routes, unchecked.
    #[serde(default, rename = "route")]
    pub routes: Vec<RouteConfig>,
}

impl RelayConfig {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let file = |reason: String| ConfigError::File {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| file(e.to_string()))?;
        Self::parse(&text).map_err(|e| match e {
            ConfigError::Toml {
                line,
                column,
                message,
                ..
            } => ConfigError::Toml {
                path: path.display().to_string(),
                line,
                column,
                message,
            },
            other => other,
        })
    }

    /// Parses the file's text; an error says where (its path left empty for
    /// [`RelayConfig::load`] to fill in).
    fn parse(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e: toml::de::Error| {
            let at = e.span().map_or(0, |span| span.start).min(text.len());
            let before = text.get(..at).unwrap_or(text);
            let line = before.matches('\n').count() + 1;
            let column = before
                .rsplit_once('\n')
                .map_or(before, |(_, tail)| tail)
                .chars()
                .count()
                + 1;
            ConfigError::Toml {
                path: String::new(),
                line,
                column,
                message: e.message().to_owned(),
            }
        })
    }

    /// Checks every route: at least one, names unique.
    pub fn check_routes(routes: Vec<RouteConfig>) -> Result<Vec<Route>, ConfigError> {
        if routes.is_empty() {
            return Err(ConfigError::Routes(
                "no route: give --from and --to, or [[route]] tables in --config".into(),
            ));
        }
        let routes = routes
            .into_iter()
            .enumerate()
            .map(|(i, r)| r.check(i))
            .collect::<Result<Vec<_>, _>>()?;
        for (i, r) in routes.iter().enumerate() {
            if routes[..i].iter().any(|o| o.name == r.name) {
                return Err(ConfigError::Routes(format!(
                    "two routes are named {:?}",
                    r.name
                )));
            }
            // Two producers with one transactional id fence each other: one route would stop.
            if let Some(id) = r.sink.transactional_id() {
                if let Some(o) = routes[..i]
                    .iter()
                    .find(|o| o.sink.transactional_id() == Some(id))
                {
                    return Err(ConfigError::Routes(format!(
                        "routes {:?} and {:?} both write transactional={id}: each route needs its own id (two producers with one id fence each other)",
                        o.name, r.name
                    )));
                }
            }
        }
        Ok(routes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(from: &str, to: &str) -> RouteConfig {
        RouteConfig {
            from: from.into(),
            to: to.into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_file_of_two_routes_checks() {
        let config: RelayConfig = toml::from_str(
            r#"
metrics_listen = "127.0.0.1:0"
[[route]]
from = "kafka://h:1/in?group=g"
to = "stdout:"
key = "{id}"
ttl = "5m"
[[route]]
name = "b"
from = "amqp://g:g@h:5672/%2f?queue=q"
to = "file:/tmp/o"
mode = "idempotent"
dead_letter = "file:/tmp/dl"
max_attempts = 3
"#,
        )
        .unwrap();
        let routes = RelayConfig::check_routes(config.routes).unwrap();
        assert_eq!(routes[0].name, "route-1");
        assert_eq!(routes[0].namespace, "relay.route-1");
        assert_eq!(routes[0].ttl, Some(Duration::from_secs(300)));
        assert_eq!(routes[1].mode, Mode::Idempotent);
        assert_eq!(routes[1].max_attempts, Some(3));
    }

    #[test]
    fn bad_settings_are_refused_with_the_field() {
        let err = |r: RouteConfig| r.check(0).unwrap_err().to_string();
        let mut r = route("kafka://h:1/in?group=g", "stdout:");
        r.mode = Some("twice".into());
        assert!(err(r).contains("mode"));
        let mut r = route("kafka://h:1/in?group=g", "stdout:");
        r.key = Some("{unclosed".into());
        assert!(err(r).contains("key"));
        let mut r = route("kafka://h:1/in?group=g", "stdout:");
        r.dead_letter = Some("file:/tmp/x".into());
        assert!(err(r).contains("its own cluster"));
        let mut r = route("kafka://h:1/in?group=g", "stdout:");
        r.ttl = Some("soon".into());
        assert!(err(r).contains("ttl"));
        assert!(RelayConfig::check_routes(vec![]).is_err());
        let twice = vec![
            route("kafka://h:1/in?group=g", "stdout:"),
            RouteConfig {
                name: Some("route-1".into()),
                ..route("kafka://h:1/in?group=g", "stdout:")
            },
        ];
        assert!(RelayConfig::check_routes(twice)
            .unwrap_err()
            .to_string()
            .contains("two routes"));
        assert!(toml::from_str::<RelayConfig>("[[route]]\nfrom='a'\nto='b'\nbogus=1").is_err());
    }

    /// A TOML error names the file, the line and the column, as an editor jumps to them.
    #[test]
    fn a_toml_error_says_where() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("relay.toml");
        std::fs::write(&path, "[[route]]\nfrom = 'a'\nto = 'b'\n  bogus = 1\n").unwrap();
        let err = RelayConfig::load(&path).unwrap_err().to_string();
        let expected = format!("{}:4:3: unknown field `bogus`", path.display());
        assert!(err.starts_with(&expected), "{err}");
        std::fs::write(&path, "metrics_listen = \"a\"\nmetrics_listen = 1\n").unwrap();
        let err = RelayConfig::load(&path).unwrap_err().to_string();
        assert!(err.contains("relay.toml:2:1: "), "{err}");
    }

    #[test]
    fn a_transactional_sink_needs_a_kafka_source_on_its_cluster_and_the_retriable_mode() {
        let err = |r: RouteConfig| r.check(0).unwrap_err().to_string();
        let tx = "kafka://h:1,g:2/out?transactional=relay-0";
        // Kafka to Kafka on one cluster (broker order aside), with a DLQ there: accepted.
        let mut r = route("kafka://g:2,h:1/in?group=g", tx);
        r.dead_letter = Some("kafka://g:2,h:1/in.dlq".into());
        let checked = r.check(0).unwrap();
        assert_eq!(checked.sink.transactional_id(), Some("relay-0"));
        let amqp = err(route("amqp://u:p@h:5672/%2f?queue=q", tx));
        assert!(amqp.contains("to: transactional= needs a Kafka source: no Kafka transaction can cover a RabbitMQ ack"), "{amqp}");
        let nats = err(route("nats://h:4222/S?consumer=c", tx));
        assert!(nats.contains("cover a JetStream ack"), "{nats}");
        let other = err(route("kafka://elsewhere:9092/in?group=g", tx));
        assert!(other.contains("to: transactional= needs the sink on the source's cluster (kafka://elsewhere:9092/TOPIC)"), "{other}");
        let mut r = route("kafka://h:1,g:2/in?group=g", tx);
        r.mode = Some("idempotent".into());
        let idempotent = err(r);
        assert!(idempotent.contains("mode: idempotent cannot run with a transactional= sink: a transaction that aborts must release its claims, and a mark cannot be released"), "{idempotent}");
        let mut r = route("kafka://h:1/in?group=g", "kafka://h:1/out");
        r.dead_letter = Some("kafka://h:1/dlq?transactional=x".into());
        assert!(err(r).contains("dead_letter: transactional= goes on the sink"));
        let same_id = vec![
            route("kafka://h:1/a?group=g", "kafka://h:1/x?transactional=t"),
            route("kafka://h:1/b?group=g", "kafka://h:1/y?transactional=t"),
        ];
        let twice = RelayConfig::check_routes(same_id).unwrap_err().to_string();
        assert!(
            twice.contains("routes \"route-1\" and \"route-2\" both write transactional=t"),
            "{twice}"
        );
        // The idempotent producer's sink takes any source and mode, as before.
        let mut r = route("nats://h:4222/S?consumer=c", "kafka://h:1/out");
        r.mode = Some("idempotent".into());
        assert!(r.check(0).is_ok());
    }
}
