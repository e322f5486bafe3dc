//! [`Route`]: one source, one sink and how the gate sits between them; and the URL forms of
//! sources ([`SourceSpec`]) and sinks ([`SinkSpec`]), parsed once, before anything connects.
//!
//! | form | as a source | as a sink |
//! |---|---|---|
//! | `kafka://HOST:PORT[,HOST:PORT…]/TOPIC?group=G` | consumer group `G` (required) | — |
//! | `kafka://HOST:PORT[,HOST:PORT…]/TOPIC` | — | idempotent producer to `TOPIC` |
//! | `kafka://HOST:PORT[,HOST:PORT…]/TOPIC?transactional=ID` | — | a Kafka source's route as one transactional pipe: records and consumed offsets committed together (`crate::config` refuses it from other sources, another cluster, the idempotent mode) |
//! | `amqp://USER:PASS@HOST:PORT/VHOST?queue=Q` | consume queue `Q` | — |
//! | `amqp://USER:PASS@HOST:PORT/VHOST?exchange=X&routing_key=K` | — | publish with confirms (`exchange` may be empty: the default exchange) |
//! | `nats://HOST:PORT/STREAM?consumer=C` | JetStream durable pull consumer `C` of `STREAM` (created when missing) | — |
//! | `nats://HOST:PORT/SUBJECT` | — | JetStream publish, `Nats-Msg-Id` = key, PubAck awaited |
//! | `stdout:` | — | JSON lines on stdout |
//! | `file:PATH` | — | JSON lines appended to `PATH`, fsync'd before confirming |
//!
//! Query values are taken literally (no percent-decoding); the AMQP URL's other parts (the
//! `%2f` vhost, credentials) are passed to the client as written.

use std::path::PathBuf;
use std::time::Duration;

use dedupgate_core::keys::KeyTemplate;
use dedupgate_core::Mode;

use crate::config::ConfigError;

/// Where a route reads from.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SourceSpec {
    /// A Kafka topic read by a consumer group.
    Kafka {
        /// `host:port[,host:port…]`.
        bootstrap: String,
        /// The topic.
        topic: String,
        /// The consumer group.
        group: String,
    },
    /// A RabbitMQ queue.
    Amqp {
        /// The AMQP URI without the relay's own query parameters.
        uri: String,
        /// The queue.
        queue: String,
    },
    /// A NATS JetStream durable pull consumer.
    Nats {
        /// `nats://host:port`.
        server: String,
        /// The stream.
        stream: String,
        /// The durable consumer's name.
        consumer: String,
    },
}

/// Where a route forwards to (and where dead letters go).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SinkSpec {
    /// JSON lines on standard output.
    Stdout,
    /// JSON lines appended to a file.
    File(PathBuf),
    /// A Kafka topic, through an idempotent producer; or, with a transactional id, produced in
    /// the transaction that commits the Kafka source's offsets.
    Kafka {
        /// `host:port[,host:port…]`.
        bootstrap: String,
        /// The topic.
        topic: String,
        /// `transactional=ID`: the producer's `transactional.id` (one per running instance).
        transactional_id: Option<String>,
    },
    /// A RabbitMQ exchange, with publisher confirms.
    Amqp {
        /// The AMQP URI without the relay's own query parameters.
        uri: String,
        /// The exchange (empty: the default exchange).
        exchange: String,
        /// The routing key.
        routing_key: String,
    },
    /// A NATS JetStream subject.
    Nats {
        /// `nats://host:port`.
        server: String,
        /// The subject.
        subject: String,
    },
}

/// A route, checked: what [`crate::run`] relays.
#[derive(Clone, Debug)]
pub struct Route {
    /// The route's name: a metrics label and the default namespace.
    pub name: String,
    /// Where messages come from.
    pub source: SourceSpec,
    /// Where they go.
    pub sink: SinkSpec,
    /// The key template over the JSON payload; `None`: the source's message id (Kafka: the
    /// `idempotency-key` header, AMQP: `message_id`, NATS: `Nats-Msg-Id`).
    pub key: Option<KeyTemplate>,
    /// Retriable (claim, forward, complete) or idempotent (mark, then forward).
    pub mode: Mode,
    /// The STORE the gate keeps keys in, as the binary's `--store` reads it; `None`: its default.
    pub store: Option<String>,
    /// The gate namespace.
    pub namespace: String,
    /// How long a key is remembered; `None`: the gate's default (24 h).
    pub ttl: Option<Duration>,
    /// Where rejected messages go, with the reason in headers.
    pub dead_letter: Option<SinkSpec>,
    /// A forward that failed on this many deliveries is dead-lettered instead of retried.
    pub max_attempts: Option<u32>,
}

/// `scheme://rest` split, and `rest`'s query split off into pairs.
struct Parts<'a> {
    scheme: &'a str,
    /// Between `scheme://` and `?`.
    base: &'a str,
    query: Vec<(&'a str, &'a str)>,
}

fn parts(url: &str) -> Option<Parts<'_>> {
    let (scheme, rest) = url.split_once("://")?;
    let (base, query) = rest.split_once('?').unwrap_or((rest, ""));
    let query = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| p.split_once('=').unwrap_or((p, "")))
        .collect();
    Some(Parts {
        scheme,
        base,
        query,
    })
}

impl<'a> Parts<'a> {
    fn take(&mut self, name: &str) -> Option<&'a str> {
        let i = self.query.iter().position(|(n, _)| *n == name)?;
        Some(self.query.remove(i).1)
    }

    /// No query parameter left that the form does not know.
    fn done(&self, url: &str, known: &str) -> Result<(), ConfigError> {
        match self.query.first() {
            Some((name, _)) => Err(bad(url, format!("unknown parameter {name:?} ({known})"))),
            None => Ok(()),
        }
    }

    /// `host:port/NAME` for Kafka and NATS: NAME is one path segment.
    fn host_and_name(&self, url: &str, what: &str) -> Result<(&'a str, &'a str), ConfigError> {
        let (host, name) = self.base.split_once('/').ok_or_else(|| {
            bad(
                url,
                format!(
                    "no {what}: write {}://HOST:PORT/{}",
                    self.scheme,
                    what.to_uppercase()
                ),
            )
        })?;
        if host.is_empty() {
            return Err(bad(url, "no host"));
        }
        if name.is_empty() || name.contains('/') {
            return Err(bad(
                url,
                format!("the {what} must be one non-empty path segment"),
            ));
        }
        Ok((host, name))
    }

    /// The AMQP URI as lapin reads it, without the relay's parameters.
    fn amqp_uri(&self) -> String {
        let mut uri = format!("{}://{}", self.scheme, self.base);
        for (i, (n, v)) in self.query.iter().enumerate() {
            uri.push(if i == 0 { '?' } else { '&' });
            uri.push_str(n);
            uri.push('=');
            uri.push_str(v);
        }
        uri
    }
}

/// A bad URL, named with its password redacted (the STORE forms' rule): errors are printed
/// and logged.
fn bad(url: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Url {
        url: dedupgate_stores::redact(url),
        reason: reason.into(),
    }
}

fn required<'a>(url: &str, value: Option<&'a str>, name: &str) -> Result<&'a str, ConfigError> {
    match value {
        Some(v) if !v.is_empty() => Ok(v),
        _ => Err(bad(url, format!("{name}= is required"))),
    }
}

const SCHEMES: &str = "kafka://, amqp://, amqps://, nats://, stdout: or file:PATH";

impl std::str::FromStr for SourceSpec {
    type Err = ConfigError;

    fn from_str(url: &str) -> Result<Self, ConfigError> {
        let Some(mut p) = parts(url) else {
            return Err(bad(url, "a source is kafka://, amqp:// or nats://"));
        };
        match p.scheme {
            "kafka" => {
                let (host, topic) = p.host_and_name(url, "topic")?;
                let group = required(url, p.take("group"), "group")?.to_owned();
                p.done(url, "a Kafka source takes group=")?;
                Ok(Self::Kafka {
                    bootstrap: host.to_owned(),
                    topic: topic.to_owned(),
                    group,
                })
            }
            "amqp" | "amqps" => {
                let queue = required(url, p.take("queue"), "queue")?.to_owned();
                Ok(Self::Amqp {
                    uri: p.amqp_uri(),
                    queue,
                })
            }
            "nats" => {
                let (host, stream) = p.host_and_name(url, "stream")?;
                let consumer = required(url, p.take("consumer"), "consumer")?.to_owned();
                p.done(url, "a NATS source takes consumer=")?;
                Ok(Self::Nats {
                    server: format!("nats://{host}"),
                    stream: stream.to_owned(),
                    consumer,
                })
            }
            other => Err(bad(
                url,
                format!(
                    "unknown source scheme {other:?}: a source is kafka://, amqp:// or nats://"
                ),
            )),
        }
    }
}

impl std::str::FromStr for SinkSpec {
    type Err = ConfigError;

    fn from_str(url: &str) -> Result<Self, ConfigError> {
        if url == "stdout:" || url == "-" {
            return Ok(Self::Stdout);
        }
        if let Some(path) = url.strip_prefix("file:") {
            if path.is_empty() {
                return Err(bad(url, "no path: write file:PATH"));
            }
            return Ok(Self::File(PathBuf::from(path)));
        }
        let Some(mut p) = parts(url) else {
            return Err(bad(url, format!("a sink is {SCHEMES}")));
        };
        match p.scheme {
            "kafka" => {
                let (host, topic) = p.host_and_name(url, "topic")?;
                let transactional_id = match p.take("transactional") {
                    Some("") => return Err(bad(url, "transactional= needs an id")),
                    id => id.map(str::to_owned),
                };
                p.done(url, "a Kafka sink takes transactional=")?;
                Ok(Self::Kafka {
                    bootstrap: host.to_owned(),
                    topic: topic.to_owned(),
                    transactional_id,
                })
            }
            "amqp" | "amqps" => {
                let exchange = p.take("exchange").unwrap_or("").to_owned();
                let routing_key = p.take("routing_key").unwrap_or("").to_owned();
                if exchange.is_empty() && routing_key.is_empty() {
                    return Err(bad(
                        url,
                        "routing_key= is required (with exchange=, or alone for the default exchange's queue of that name)",
                    ));
                }
                Ok(Self::Amqp {
                    uri: p.amqp_uri(),
                    exchange,
                    routing_key,
                })
            }
            "nats" => {
                let (host, subject) = p.host_and_name(url, "subject")?;
                p.done(url, "a NATS sink takes none")?;
                Ok(Self::Nats {
                    server: format!("nats://{host}"),
                    subject: subject.to_owned(),
                })
            }
            other => Err(bad(
                url,
                format!("unknown sink scheme {other:?}: a sink is {SCHEMES}"),
            )),
        }
    }
}

impl SinkSpec {
    /// The transactional id of a Kafka sink written with `transactional=ID`.
    pub fn transactional_id(&self) -> Option<&str> {
        match self {
            Self::Kafka {
                transactional_id, ..
            } => transactional_id.as_deref(),
            _ => None,
        }
    }
}

impl std::fmt::Display for SinkSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Stdout => f.write_str("stdout:"),
            Self::File(path) => write!(f, "file:{}", path.display()),
            Self::Kafka {
                bootstrap,
                topic,
                transactional_id: None,
            } => write!(f, "kafka://{bootstrap}/{topic}"),
            Self::Kafka {
                bootstrap,
                topic,
                transactional_id: Some(id),
            } => write!(f, "kafka://{bootstrap}/{topic}?transactional={id}"),
            Self::Amqp {
                exchange,
                routing_key,
                ..
            } => write!(
                f,
                "amqp (exchange {exchange:?}, routing key {routing_key:?})"
            ),
            Self::Nats { server, subject } => write!(f, "{server}/{subject}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse() {
        assert_eq!(
            "kafka://127.0.0.1:9092,b:9092/orders?group=relay"
                .parse::<SourceSpec>()
                .unwrap(),
            SourceSpec::Kafka {
                bootstrap: "127.0.0.1:9092,b:9092".into(),
                topic: "orders".into(),
                group: "relay".into()
            }
        );
        assert_eq!(
            "amqp://guest:guest@h:5672/%2f?queue=q&heartbeat=10"
                .parse::<SourceSpec>()
                .unwrap(),
            SourceSpec::Amqp {
                uri: "amqp://guest:guest@h:5672/%2f?heartbeat=10".into(),
                queue: "q".into()
            }
        );
        assert_eq!(
            "nats://h:4222/S?consumer=c".parse::<SourceSpec>().unwrap(),
            SourceSpec::Nats {
                server: "nats://h:4222".into(),
                stream: "S".into(),
                consumer: "c".into()
            }
        );
    }

    #[test]
    fn bad_sources_say_what_is_missing() {
        let err = |u: &str| u.parse::<SourceSpec>().unwrap_err().to_string();
        assert!(
            err("kafka://h:1/t").contains("group= is required"),
            "{}",
            err("kafka://h:1/t")
        );
        assert!(err("kafka://h:1").contains("no topic"));
        assert!(err("kafka://h:1/t?group=g&x=1").contains("unknown parameter \"x\""));
        assert!(err("amqp://h/%2f").contains("queue= is required"));
        let secret = err("amqp://guest:s3cret@h/%2f");
        assert!(
            secret.contains("amqp://guest:***@h/%2f") && !secret.contains("s3cret"),
            "{secret}"
        );
        assert!(err("nats://h/S").contains("consumer= is required"));
        assert!(err("http://h/x").contains("unknown source scheme \"http\""));
        assert!(err("orders").contains("a source is"));
        assert!(err("stdout:").contains("a source is"));
    }

    #[test]
    fn sinks_parse() {
        assert_eq!("stdout:".parse::<SinkSpec>().unwrap(), SinkSpec::Stdout);
        assert_eq!(
            "file:/tmp/x.jsonl".parse::<SinkSpec>().unwrap(),
            SinkSpec::File("/tmp/x.jsonl".into())
        );
        assert_eq!(
            "kafka://h:1/out".parse::<SinkSpec>().unwrap(),
            SinkSpec::Kafka {
                bootstrap: "h:1".into(),
                topic: "out".into(),
                transactional_id: None,
            }
        );
        let tx = "kafka://h:1/out?transactional=relay-0"
            .parse::<SinkSpec>()
            .unwrap();
        assert_eq!(
            tx,
            SinkSpec::Kafka {
                bootstrap: "h:1".into(),
                topic: "out".into(),
                transactional_id: Some("relay-0".into()),
            }
        );
        assert_eq!(tx.transactional_id(), Some("relay-0"));
        assert_eq!(tx.to_string(), "kafka://h:1/out?transactional=relay-0");
        assert_eq!(
            "amqp://g:g@h:5672/%2f?exchange=x&routing_key=k"
                .parse::<SinkSpec>()
                .unwrap(),
            SinkSpec::Amqp {
                uri: "amqp://g:g@h:5672/%2f".into(),
                exchange: "x".into(),
                routing_key: "k".into()
            }
        );
        assert_eq!(
            "nats://h:4222/orders.out".parse::<SinkSpec>().unwrap(),
            SinkSpec::Nats {
                server: "nats://h:4222".into(),
                subject: "orders.out".into()
            }
        );
        let err = |u: &str| u.parse::<SinkSpec>().unwrap_err().to_string();
        assert!(err("file:").contains("no path"));
        assert!(err("amqp://h/%2f").contains("routing_key= is required"));
        assert!(err("kafka://h:1/t?group=g").contains("unknown parameter"));
        assert!(err("kafka://h:1/t?transactional=").contains("transactional= needs an id"));
        assert!(err("s3://b/k").contains("unknown sink scheme"));
    }
}
