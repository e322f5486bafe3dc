//! The connection to one server or a cluster: how it is opened, rebuilt after failures the
//! `redis` crate does not recover from, and how a pipeline is started and sent on it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, Value};

use crate::options::{cluster_nodes, RedisOptions};
use crate::OpenError;

#[derive(Clone)]
pub(crate) enum Conn {
    Single(Arc<Rebuilt<ConnectionManager>>),
    Cluster(Arc<Rebuilt<ClusterConnection>>),
}

impl Conn {
    /// Connects to `url` (`redis+cluster://h:p,…` for a cluster) with the timeouts of `opts`;
    /// `shown` is the URL as messages show it (password redacted).
    pub(crate) async fn open(
        url: &str,
        shown: &str,
        opts: &RedisOptions,
    ) -> Result<Self, OpenError> {
        let connect_err = |e: redis::RedisError| connect_error(shown.to_owned(), e);
        let conn = if url.starts_with("redis+cluster://") {
            let nodes = cluster_nodes(url)?;
            let client = ClusterClientBuilder::new(nodes)
                .connection_timeout(Duration::from_millis(opts.connect_timeout_ms))
                .response_timeout(Duration::from_millis(opts.response_timeout_ms))
                .retries(2)
                .min_retry_wait(20)
                .max_retry_wait(200)
                .build()
                .map_err(|e| OpenError::Url(format!("{shown}: {e}")))?;
            let conn = client.get_async_connection().await.map_err(connect_err)?;
            Conn::Cluster(Rebuilt::new(
                conn,
                |_| true,
                move || {
                    let client = client.clone();
                    Box::pin(async move { client.get_async_connection().await })
                },
            ))
        } else {
            let client =
                redis::Client::open(url).map_err(|e| OpenError::Url(format!("{shown}: {e}")))?;
            // Few reconnection retries: while Redis is down an operation should fail fast as
            // `unavailable`; the next operation tries to reconnect again.
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(Duration::from_millis(opts.connect_timeout_ms)))
                .set_response_timeout(Some(Duration::from_millis(opts.response_timeout_ms)))
                .set_number_of_retries(1)
                .set_min_delay(Duration::from_millis(20))
                .set_max_delay(Duration::from_millis(200));
            let conn = ConnectionManager::new_with_config(client.clone(), config.clone())
                .await
                .map_err(connect_err)?;
            Conn::Single(Rebuilt::new(
                conn,
                redis::RedisError::is_unrecoverable_error,
                move || {
                    let (client, config) = (client.clone(), config.clone());
                    Box::pin(
                        async move { ConnectionManager::new_with_config(client, config).await },
                    )
                },
            ))
        };
        Ok(conn)
    }
}

impl Conn {
    /// A new pipeline for `key_commands` commands on the slot of `guard` (one of their keys),
    /// with room for `capacity` commands, and how many replies of its own the caller skips.
    ///
    /// On a cluster, more than one key command go after a read of `guard` (`EXISTS`, its reply
    /// skipped). While a slot migrates, its source node answers `ASK` for keys it does not
    /// hold, and the client then sends the whole pipeline to the target behind a single
    /// `ASKING`, which admits only the pipeline's first command there (the rest are refused
    /// with `MOVED`, and the batch is answered "unavailable", safe to retry). Without the read,
    /// that first command was a write that ran on the target for a key the source still held:
    /// a second, stray copy of a live record, which later broke the slot's `MIGRATE` with
    /// `BUSYKEY` (`tests/resharding.rs`). A pipeline with one key command needs no read: that
    /// command got `ASK` only if the source does not hold its keys, so it belongs on the target.
    pub(crate) fn start_pipeline(
        &self,
        capacity: usize,
        key_commands: usize,
        guard: &[u8],
    ) -> (Pipeline, usize) {
        let mut pipe = Pipeline::with_capacity(capacity + 1);
        if matches!(self, Conn::Cluster(_)) && key_commands > 1 {
            pipe.cmd("EXISTS").arg(guard);
            (pipe, 1)
        } else {
            (pipe, 0)
        }
    }

    /// Sends `pipe` and answers `count` replies after its first `offset` (see
    /// [`Conn::start_pipeline`]).
    pub(crate) async fn pipeline(
        &self,
        pipe: &Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisResult<Vec<Value>> {
        match self {
            Conn::Single(h) => {
                let r = h.current().req_packed_commands(pipe, offset, count).await;
                h.check(&r);
                r
            }
            Conn::Cluster(h) => {
                let r = h.current().req_packed_commands(pipe, offset, count).await;
                h.check(&r);
                r
            }
        }
    }
}

/// A connection that is rebuilt from its client after failures the `redis` crate does not
/// recover from by itself:
/// - a cluster connection, after a master was killed and restarted, was seen to time out every
///   request for good (any error rebuilds it);
/// - a single server's `ConnectionManager` reconnects after a dropped connection, but when that
///   reconnection itself fails with anything but an I/O error (a reply cut short during the
///   handshake: a parse error) it keeps answering that same error to every later request and
///   never tries again (redis 1.8 `reconnect_if_io_error!`). Found by `dedupgate-torture`'s
///   net-fault run over a TCP proxy that truncates replies: every answer after one truncation
///   was "Parse error … Unexpected end of input" until the end of the run. Such errors (the
///   `redis` crate's "reconnect" class) rebuild the manager.
pub(crate) struct Rebuilt<C> {
    conn: std::sync::RwLock<C>,
    rebuilding: AtomicBool,
    /// Whether an error calls for a rebuild.
    rebuild_on: fn(&redis::RedisError) -> bool,
    connect:
        Box<dyn Fn() -> futures::future::BoxFuture<'static, redis::RedisResult<C>> + Send + Sync>,
}

impl Rebuilt<ConnectionManager> {
    /// Sends one command (a rebuild follows the errors that call for one).
    pub(crate) async fn command(self: &Arc<Self>, cmd: &Cmd) -> redis::RedisResult<Value> {
        let r = self.current().req_packed_command(cmd).await;
        self.check(&r);
        r
    }
}

/// Least time between two rebuilds of a connection.
const REBUILD_INTERVAL: Duration = Duration::from_secs(1);

impl<C: Clone + Send + Sync + 'static> Rebuilt<C> {
    pub(crate) fn new(
        conn: C,
        rebuild_on: fn(&redis::RedisError) -> bool,
        connect: impl Fn() -> futures::future::BoxFuture<'static, redis::RedisResult<C>>
            + Send
            + Sync
            + 'static,
    ) -> Arc<Self> {
        Arc::new(Self {
            conn: std::sync::RwLock::new(conn),
            rebuilding: AtomicBool::new(false),
            rebuild_on,
            connect: Box::new(connect),
        })
    }

    pub(crate) fn current(&self) -> C {
        self.conn.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Starts a rebuild when `result` failed in a way that calls for one.
    pub(crate) fn check<T>(self: &Arc<Self>, result: &redis::RedisResult<T>) {
        if let Err(e) = result {
            if (self.rebuild_on)(e) {
                self.failed();
            }
        }
    }

    /// Starts a rebuild in the background, unless one ran within the last second.
    pub(crate) fn failed(self: &Arc<Self>) {
        if self.rebuilding.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            if let Ok(fresh) = (me.connect)().await {
                *me.conn.write().unwrap_or_else(|p| p.into_inner()) = fresh;
            }
            tokio::time::sleep(REBUILD_INTERVAL).await;
            me.rebuilding.store(false, Ordering::Release);
        });
    }
}

/// True when `e` is the server refusing the connection's credentials: a failed `AUTH` or
/// `HELLO … AUTH` (`WRONGPASS`), or a command sent without authenticating to a server that
/// requires it (`NOAUTH`, an error code the client does not know).
pub(crate) fn is_auth_refusal(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(e.code(), Some("NOAUTH" | "WRONGPASS"))
}

/// An error reply from a server that is loading, has its cluster down or asks to try again:
/// it will pass, unlike other error replies.
pub(crate) fn server_busy(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown,
        )
    )
}

/// A connection that could not be set up (connect, `AUTH`/`HELLO`, `SELECT`). The server's
/// refusal of the credentials ([`OpenError::Auth`]) or of the setup the URL asks for (a
/// database index out of range, a client configuration it rejects: [`OpenError::Refused`])
/// will not pass by retrying; no connection, an I/O error, a timeout, a reply cut short or a
/// server busy loading or with its cluster down is [`OpenError::Connect`], worth retrying.
pub(crate) fn connect_error(url: String, e: redis::RedisError) -> OpenError {
    use redis::ErrorKind;
    let reason = e.to_string();
    if is_auth_refusal(&e) {
        return OpenError::Auth { url, reason };
    }
    let refused = !server_busy(&e)
        && matches!(
            e.kind(),
            ErrorKind::Server(_)
                | ErrorKind::Extension
                | ErrorKind::InvalidClientConfig
                | ErrorKind::RESP3NotSupported
        );
    if refused {
        OpenError::Refused { url, reason }
    } else {
        OpenError::Connect { url, reason }
    }
}
