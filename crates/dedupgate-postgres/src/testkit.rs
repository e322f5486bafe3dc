//! A PostgreSQL server a test or torture run owns, so it can `kill -9` and restart it:
//! [`OwnedPg`] runs initdb and pg_ctl from the installed binaries (`DEDUPGATE_PG_BIN`, default
//! `/usr/lib/postgresql/15/bin`) on a free loopback port, fsync and synchronous commit on, in a
//! directory under the temp dir that is removed on drop. initdb and postgres refuse to run as
//! root, so as root every command runs as the `postgres` user through `runuser`, in a directory
//! it owns. Nothing is mocked; errors are returned, never panics.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use rustix::process::{kill_process, test_kill_process, Pid, Signal};

/// Where Debian/Ubuntu install PostgreSQL 15's server binaries (override with `DEDUPGATE_PG_BIN`).
fn bin_dir() -> PathBuf {
    std::env::var_os("DEDUPGATE_PG_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"))
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

fn postgres_ids() -> std::io::Result<(u32, u32)> {
    let id = |flag: &str| -> std::io::Result<u32> {
        let out = Command::new("id").args([flag, "postgres"]).output()?;
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<u32>()
            .map_err(|_| std::io::Error::other("no postgres user to run the server as"))
    };
    Ok((id("-u")?, id("-g")?))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// One owned server; stopped (immediate) and its directory removed on drop.
#[derive(Debug)]
pub struct OwnedPg {
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
}

impl OwnedPg {
    /// initdb and start a server on a free loopback port.
    pub fn start() -> std::io::Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let dir = std::env::temp_dir().join(format!(
            "dedupgate-pg-{}-{port}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir)?;
        let as_postgres = is_root();
        if as_postgres {
            let (uid, gid) = postgres_ids()?;
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
        }
        let pg = Self {
            dir,
            port,
            as_postgres,
        };
        let data = pg.data();
        let out = pg.run(
            "initdb",
            &[
                "-D",
                &data.to_string_lossy(),
                "-U",
                "postgres",
                "-A",
                "trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        )?;
        if !out.status.success() {
            return Err(std::io::Error::other(format!(
                "initdb failed: {}",
                text(&out)
            )));
        }
        pg.pg_ctl_start()?;
        Ok(pg)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// A URL for the server's `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The directory, for messages.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn run(&self, tool: &str, args: &[&str]) -> std::io::Result<Output> {
        let exe = bin_dir().join(tool);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        cmd.args(args)
            .current_dir(&self.dir)
            .output()
            .map_err(|e| std::io::Error::new(e.kind(), format!("run {}: {e}", exe.display())))
    }

    fn pg_ctl_start(&self) -> std::io::Result<()> {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=on -c synchronous_commit=on \
             -c shared_buffers=16MB -c max_connections=80",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("server.log");
        // Right after a kill -9, orphaned backends may hold the old shared memory for a moment:
        // the new postmaster refuses to start until they are gone, so retry.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = self.run(
                "pg_ctl",
                &[
                    "-D",
                    &self.data().to_string_lossy(),
                    "-o",
                    &opts,
                    "-l",
                    &log.to_string_lossy(),
                    "-w",
                    "-t",
                    "30",
                    "start",
                ],
            )?;
            if out.status.success() {
                return Ok(());
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(std::io::Error::other(format!(
                    "pg_ctl start failed: {}\n{log}",
                    text(&out)
                )));
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    fn postmaster_pid(&self) -> Option<Pid> {
        let text = std::fs::read_to_string(self.data().join("postmaster.pid")).ok()?;
        Pid::from_raw(text.lines().next()?.trim().parse().ok()?)
    }

    /// Every live process of this cluster (the postmaster and its backends all run with the data
    /// directory as their working directory).
    fn cluster_pids(&self) -> Vec<Pid> {
        let data = std::fs::canonicalize(self.data()).unwrap_or_else(|_| self.data());
        std::fs::read_dir("/proc")
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| {
                        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
                        let cwd = std::fs::read_link(e.path().join("cwd")).ok()?;
                        (cwd == data).then_some(())?;
                        Pid::from_raw(pid)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `kill -9` of the postmaster only (its backends notice and exit on their own); see
    /// [`OwnedPg::any_process_alive`] to wait for them and [`OwnedPg::restart`] to start again.
    pub fn kill9(&self) -> std::io::Result<()> {
        let pid = self
            .postmaster_pid()
            .ok_or_else(|| std::io::Error::other("no running postmaster"))?;
        kill_process(pid, Signal::KILL)?;
        Ok(())
    }

    /// `kill -9` of the postmaster and of every backend at once (as a host crash would end
    /// them), then a start on the same data directory and port: crash recovery replays the WAL.
    pub fn kill9_and_restart(&self) -> std::io::Result<()> {
        if let Some(pid) = self.postmaster_pid() {
            let _ = kill_process(pid, Signal::KILL);
            for p in self.cluster_pids() {
                let _ = kill_process(p, Signal::KILL);
            }
            // Until it is gone, pg_ctl would see it still running.
            let gone = Instant::now() + Duration::from_secs(10);
            while Instant::now() < gone
                && test_kill_process(pid).is_ok()
                && !std::fs::read_to_string(format!("/proc/{}/stat", pid.as_raw_nonzero()))
                    .is_ok_and(|s| {
                        s.rsplit_once(')')
                            .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
                    })
            {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        self.pg_ctl_start()
    }

    /// Starts the server again on the same data directory and port (crash recovery runs).
    pub fn restart(&self) -> std::io::Result<()> {
        self.pg_ctl_start()
    }

    /// True while something accepts connections on the port.
    pub fn accepting(&self) -> bool {
        std::net::TcpStream::connect_timeout(
            &std::net::SocketAddr::from(([127, 0, 0, 1], self.port)),
            Duration::from_millis(200),
        )
        .is_ok()
    }

    /// True while any process of this cluster lives (the postmaster or a backend it left behind).
    pub fn any_process_alive(&self) -> bool {
        !self.cluster_pids().is_empty()
    }
}

impl Drop for OwnedPg {
    fn drop(&mut self) {
        let _ = self.run(
            "pg_ctl",
            &[
                "-D",
                &self.data().to_string_lossy(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ],
        );
        // Only if stop failed and the pid file still names this cluster's postmaster (never a
        // reused pid).
        if let Some(pid) = self.postmaster_pid() {
            let cmdline = std::fs::read(format!("/proc/{}/cmdline", pid.as_raw_nonzero()))
                .unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&*self.dir.to_string_lossy()) {
                let _ = kill_process(pid, Signal::KILL);
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
