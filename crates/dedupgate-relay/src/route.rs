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
//! | `http://HOST:PORT/PATH`, `https://…` | — | webhook: POST with `Idempotency-Key` and `Dedupgate-Fence`; 2xx confirms, 408/429/5xx retried, other 4xx dead-lettered |
//! | `postgres://USER@HOST:PORT/DB?table=T[&key_column=K][&payload_column=P][&version_column=V][&version=fence\|FIELD]` | — | upsert by key, refusing a row whose version is not higher than the stored one ([`PgUpsert`]) |
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
    /// An HTTP(S) endpoint each message is POSTed to.
    Webhook {
        /// The URL, as written.
        url: String,
    },
    /// A PostgreSQL table upserted by key, stale versions refused.
    Postgres(PgUpsert),
}

/// Where a PostgreSQL upsert sink takes a row's version from.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PgVersion {
    /// The gate's fencing token: it grows with every new claim of a key.
    Fence,
    /// An integer field at the top level of the JSON payload (an event's sequence number).
    Field(String),
}

/// A PostgreSQL upsert sink: the connection and the table's names, each identifier checked
/// (ASCII letters, digits and `_`, not starting with a digit, at most 63 bytes; the table may
/// be `schema.table`), so the statement quoting them is safe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgUpsert {
    /// The connection URL without the sink's own parameters (as tokio-postgres reads it).
    pub conninfo: String,
    /// `table=`: the table, or `schema.table`.
    pub table: String,
    /// `key_column=` (default `key`): text, unique (the conflict target).
    pub key_column: String,
    /// `payload_column=` (default `payload`): jsonb.
    pub payload_column: String,
    /// `version_column=` (default `version`): bigint.
    pub version_column: String,
    /// `version=fence` (default) or `version=FIELD`.
    pub version: PgVersion,
}

/// PostgreSQL's identifier length limit (NAMEDATALEN − 1).
const PG_IDENTIFIER_BYTES_MAX: usize = 63;

/// `name` if it is a plain identifier, else why not.
fn pg_identifier(name: &str) -> Result<(), String> {
    let plain = name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && name.bytes().next().is_some_and(|b| !b.is_ascii_digit());
    if !plain || name.len() > PG_IDENTIFIER_BYTES_MAX {
        return Err(format!(
            "{name:?} is not a plain identifier (ASCII letters, digits and _, not starting with a digit, 1 to {PG_IDENTIFIER_BYTES_MAX} bytes)"
        ));
    }
    Ok(())
}

/// An identifier as SQL text, quoted (checked plain, so no quote to double).
fn quoted(name: &str) -> String {
    format!("\"{name}\"")
}

impl PgUpsert {
    /// The upsert: a new key inserted, a known one overwritten only by a higher version.
    pub fn upsert_sql(&self) -> String {
        let table = self
            .table
            .split('.')
            .map(quoted)
            .collect::<Vec<_>>()
            .join(".");
        let (k, p, v) = (
            quoted(&self.key_column),
            quoted(&self.payload_column),
            quoted(&self.version_column),
        );
        format!(
            "INSERT INTO {table} AS stored ({k}, {p}, {v}) VALUES ($1::text, $2::text::jsonb, $3::bigint) \
             ON CONFLICT ({k}) DO UPDATE SET {p} = EXCLUDED.{p}, {v} = EXCLUDED.{v} \
             WHERE stored.{v} < EXCLUDED.{v}"
        )
    }
}

impl std::fmt::Display for PgUpsert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let conninfo = dedupgate_stores::redact(&self.conninfo);
        let conninfo = conninfo.split('?').next().unwrap_or_default();
        write!(f, "{conninfo} (table {})", self.table)
    }
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

    /// The URL as its client reads it (lapin, tokio-postgres), without the relay's parameters.
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

const SCHEMES: &str =
    "kafka://, amqp://, amqps://, nats://, http://, https://, postgres://, stdout: or file:PATH";

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
            // The whole URL is the endpoint, its query included.
            "http" | "https" => {
                if p.base
                    .split(['/', '?'])
                    .next()
                    .unwrap_or_default()
                    .is_empty()
                {
                    return Err(bad(url, "no host"));
                }
                Ok(Self::Webhook {
                    url: url.to_owned(),
                })
            }
            "postgres" | "postgresql" => pg_upsert(url, p).map(Self::Postgres),
            other => Err(bad(
                url,
                format!("unknown sink scheme {other:?}: a sink is {SCHEMES}"),
            )),
        }
    }
}

/// A `postgres://` sink URL: the sink's parameters taken out and checked, the rest passed on.
fn pg_upsert(url: &str, mut p: Parts<'_>) -> Result<PgUpsert, ConfigError> {
    let table = required(url, p.take("table"), "table")?.to_owned();
    let column = |p: &mut Parts<'_>, name: &str, default: &str| {
        let column = p.take(name).unwrap_or(default).to_owned();
        pg_identifier(&column).map_err(|why| bad(url, format!("{name}=: {why}")))?;
        Ok::<_, ConfigError>(column)
    };
    let key_column = column(&mut p, "key_column", "key")?;
    let payload_column = column(&mut p, "payload_column", "payload")?;
    let version_column = column(&mut p, "version_column", "version")?;
    let version = match p.take("version") {
        None | Some("fence") => PgVersion::Fence,
        Some(field) if !field.is_empty() => PgVersion::Field(field.to_owned()),
        Some(_) => return Err(bad(url, "version= is fence or a payload field's name")),
    };
    let (schema, name) = match table.split_once('.') {
        Some((schema, name)) => (Some(schema), name),
        None => (None, table.as_str()),
    };
    for part in schema.into_iter().chain([name]) {
        pg_identifier(part).map_err(|why| bad(url, format!("table=: {why}")))?;
    }
    if [&payload_column, &version_column].contains(&&key_column) || payload_column == version_column
    {
        return Err(bad(
            url,
            "key_column=, payload_column= and version_column= must be three different columns",
        ));
    }
    Ok(PgUpsert {
        conninfo: p.amqp_uri(),
        table,
        key_column,
        payload_column,
        version_column,
        version,
    })
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
            Self::Webhook { url } => f.write_str(&dedupgate_stores::redact(url)),
            Self::Postgres(upsert) => upsert.fmt(f),
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

    #[test]
    fn webhook_sinks_keep_the_whole_url() {
        assert_eq!(
            "https://h:8443/hooks/in?x=1".parse::<SinkSpec>().unwrap(),
            SinkSpec::Webhook {
                url: "https://h:8443/hooks/in?x=1".into()
            }
        );
        let secret: SinkSpec = "http://u:s3cret@h/p".parse().unwrap();
        assert_eq!(secret.to_string(), "http://u:***@h/p");
        let err = "http:///p".parse::<SinkSpec>().unwrap_err().to_string();
        assert!(err.contains("no host"), "{err}");
    }

    #[test]
    fn postgres_sinks_parse_with_defaults_and_refuse_unsafe_names() {
        let SinkSpec::Postgres(pg) = "postgres://u:pw@h:5432/db?table=orders&sslmode=disable"
            .parse::<SinkSpec>()
            .unwrap()
        else {
            panic!("a postgres sink")
        };
        assert_eq!(pg.conninfo, "postgres://u:pw@h:5432/db?sslmode=disable");
        assert_eq!(
            (&*pg.key_column, &*pg.payload_column, &*pg.version_column),
            ("key", "payload", "version")
        );
        assert_eq!(pg.version, PgVersion::Fence);
        assert_eq!(pg.to_string(), "postgres://u:***@h:5432/db (table orders)");
        assert!(pg.upsert_sql().contains(
            r#"ON CONFLICT ("key") DO UPDATE SET "payload" = EXCLUDED."payload", "version" = EXCLUDED."version" WHERE stored."version" < EXCLUDED."version""#
        ));
        let SinkSpec::Postgres(pg) =
            "postgres://h/db?table=app.state&key_column=id&version=seq&payload_column=doc&version_column=v"
                .parse::<SinkSpec>()
                .unwrap()
        else {
            panic!("a postgres sink")
        };
        assert_eq!(pg.version, PgVersion::Field("seq".into()));
        assert!(pg
            .upsert_sql()
            .starts_with(r#"INSERT INTO "app"."state" AS stored ("id", "doc", "v")"#));

        let err = |u: &str| u.parse::<SinkSpec>().unwrap_err().to_string();
        assert!(err("postgres://h/db").contains("table= is required"));
        assert!(err("postgres://relay@h/db?table=a;b").contains("postgres://relay@h/db?"));
        for bad in [
            "orders;drop table x",
            "a.b.c",
            "\"q\"",
            "1st",
            "t-1",
            &"t".repeat(64),
        ] {
            let e = err(&format!("postgres://h/db?table={bad}"));
            assert!(
                e.contains("table=") && e.contains("not a plain identifier"),
                "{bad}: {e}"
            );
        }
        assert!(err("postgres://h/db?table=t&key_column=k%22").contains("key_column="));
        assert!(err("postgres://h/db?table=t&key_column=payload").contains("three different"));
        assert!(err("postgres://h/db?table=t&version=").contains("version= is fence"));
    }
}
