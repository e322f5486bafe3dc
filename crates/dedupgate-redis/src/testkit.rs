//! Real Redis servers for tests and benchmarks: [`RedisServer`] starts a `redis-server` of its
//! own on a free loopback port (killed on drop), [`RedisCluster`] starts three masters and joins
//! them with `redis-cli --cluster create`. Both use the installed binaries; nothing is mocked.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

/// How long a started server may take to answer `PING`.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A URL for the shared local Redis: `DEDUPGATE_TEST_REDIS_URL`, or `redis://127.0.0.1:6379`.
pub fn shared_redis_url() -> String {
    std::env::var("DEDUPGATE_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A free loopback port whose cluster-bus twin (`port + 10000`) is free too.
pub fn free_port() -> u16 {
    loop {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
        let port = l.local_addr().expect("local addr").port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// A `redis-server` this process started; killed (SIGKILL) and reaped on drop.
#[derive(Debug)]
pub struct RedisServer {
    port: u16,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
    _tmp: Option<tempfile::TempDir>,
}

impl RedisServer {
    /// Starts a server with `extra` config arguments (e.g. `["--appendonly", "yes"]`) in a fresh
    /// temporary directory on a free port.
    pub fn start(extra: &[&str]) -> std::io::Result<Self> {
        let tmp = tempfile::tempdir()?;
        let dir = tmp.path().to_path_buf();
        let mut last = None;
        for _ in 0..5 {
            let port = free_port();
            match Self::start_in(&dir, port, extra) {
                Ok(mut s) => {
                    s._tmp = Some(tmp);
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("could not start redis-server")))
    }

    /// Starts a replica of the server on `primary_port` (with `extra` config arguments) and
    /// waits, up to 20 s, until its link to the primary is up.
    pub fn start_replica(primary_port: u16, extra: &[&str]) -> std::io::Result<Self> {
        let port = primary_port.to_string();
        let mut args = vec!["--replicaof", "127.0.0.1", port.as_str()];
        args.extend_from_slice(extra);
        let replica = Self::start(&args)?;
        let started = std::time::Instant::now();
        while !replica
            .cli(&["INFO", "replication"])?
            .contains("master_link_status:up")
        {
            if started.elapsed() > std::time::Duration::from_secs(20) {
                return Err(std::io::Error::other("replica never linked"));
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Ok(replica)
    }

    /// Starts a server in `dir` on `port` (the directory is kept when the server goes).
    pub fn start_in(dir: &Path, port: u16, extra: &[&str]) -> std::io::Result<Self> {
        let mut s = Self {
            port,
            dir: dir.to_path_buf(),
            args: extra.iter().map(|a| (*a).to_owned()).collect(),
            child: None,
            _tmp: None,
        };
        s.spawn()?;
        Ok(s)
    }

    fn spawn(&mut self) -> std::io::Result<()> {
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--dir")
            .arg(&self.dir)
            .arg("--save")
            .arg("")
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut child = cmd.spawn()?;
        let started = Instant::now();
        loop {
            if let Some(status) = child.try_wait()? {
                return Err(std::io::Error::other(format!(
                    "redis-server on port {} exited at start ({status}); see {}",
                    self.port,
                    self.dir.join("redis.log").display()
                )));
            }
            if self.cli(&["PING"]).is_ok_and(|out| out.trim() == "PONG") {
                break;
            }
            if started.elapsed() > START_TIMEOUT {
                let _ = child.kill();
                let _ = child.wait();
                return Err(std::io::Error::other("redis-server did not answer PING"));
            }
            sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
        Ok(())
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's process id while it runs (to stop it with SIGSTOP, say).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its data directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Runs `redis-cli -p PORT ARGS…` and returns its output.
    pub fn cli(&self, args: &[&str]) -> std::io::Result<String> {
        cli(self.port, args)
    }

    /// Kills the server with SIGKILL (no shutdown, no final fsync) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, directory and arguments.
    pub fn restart(&mut self) -> std::io::Result<()> {
        self.kill();
        let started = Instant::now();
        loop {
            match self.spawn() {
                Ok(()) => return Ok(()),
                // The port may linger for a moment after the kill.
                Err(e) if started.elapsed() < START_TIMEOUT => {
                    let _ = e;
                    sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs `redis-cli -p PORT ARGS…`.
pub fn cli(port: u16, args: &[&str]) -> std::io::Result<String> {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A Redis Cluster of three masters (no replicas) on free loopback ports; torn down on drop.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three `cluster-enabled` servers, joins them with `redis-cli --cluster create` and
    /// waits until every node reports `cluster_state:ok`.
    pub fn start() -> std::io::Result<Self> {
        Self::start_with(&["--appendonly", "no"])
    }

    /// Like [`RedisCluster::start`], with `extra` arguments for every node (e.g. persistence).
    pub fn start_with(extra: &[&str]) -> std::io::Result<Self> {
        let mut nodes = Vec::new();
        for _ in 0..3 {
            let mut args = vec![
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "5000",
            ];
            args.extend_from_slice(extra);
            nodes.push(RedisServer::start(&args)?);
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let mut args: Vec<&str> = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"]);
        let out = Command::new("redis-cli")
            .args(&args)
            .stdin(Stdio::null())
            .output()?;
        if !out.status.success() {
            return Err(std::io::Error::other(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let started = Instant::now();
        loop {
            let ok = nodes.iter().all(|n| {
                n.cli(&["CLUSTER", "INFO"])
                    .is_ok_and(|info| info.contains("cluster_state:ok"))
            });
            if ok {
                break;
            }
            if started.elapsed() > START_TIMEOUT {
                return Err(std::io::Error::other(
                    "cluster never reached cluster_state:ok",
                ));
            }
            sleep(Duration::from_millis(50));
        }
        Ok(Self { nodes })
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3`.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// The nodes.
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The nodes, to kill and restart one.
    pub fn nodes_mut(&mut self) -> &mut [RedisServer] {
        &mut self.nodes
    }

    /// Waits until every node reports `cluster_state:ok`.
    pub fn wait_ok(&self) -> std::io::Result<()> {
        let started = Instant::now();
        while !self.nodes.iter().all(|n| {
            n.cli(&["CLUSTER", "INFO"])
                .is_ok_and(|info| info.contains("cluster_state:ok"))
        }) {
            if started.elapsed() > START_TIMEOUT {
                return Err(std::io::Error::other(
                    "cluster never reached cluster_state:ok",
                ));
            }
            sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// The slot ranges node `i` serves, from `CLUSTER NODES`.
    pub fn slots_of(&self, i: usize) -> std::io::Result<Vec<std::ops::RangeInclusive<u16>>> {
        let out = self.nodes[i].cli(&["CLUSTER", "NODES"])?;
        let me = out
            .lines()
            .find(|l| l.contains("myself"))
            .ok_or_else(|| std::io::Error::other("no myself line in CLUSTER NODES"))?;
        Ok(me
            .split_whitespace()
            .skip(8)
            .filter_map(|r| match r.split_once('-') {
                Some((a, b)) => Some(a.parse().ok()?..=b.parse().ok()?),
                None => r.parse().ok().map(|s| s..=s),
            })
            .collect())
    }
}
