//! A PostgreSQL server the test owns: initdb + pg_ctl from the installed binaries, on a free port,
//! in a temporary directory, killed and removed on drop. initdb and postgres refuse to run as root,
//! so as root every command runs as the `postgres` user (runuser), in a directory it owns.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Where Debian/Ubuntu install PostgreSQL 15's server binaries (override with DEDUPGATE_PG_BIN).
fn bin_dir() -> PathBuf {
    std::env::var_os("DEDUPGATE_PG_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"))
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn postgres_ids() -> (u32, u32) {
    let id = |flag: &str| {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .expect("run id");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<u32>()
            .expect("a postgres user exists")
    };
    (id("-u"), id("-g"))
}

/// One owned server.
pub struct OwnedPg {
    dir: PathBuf,
    port: u16,
    as_postgres: bool,
}

impl OwnedPg {
    /// initdb and start a server on a free loopback port.
    pub fn start() -> Self {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
            l.local_addr().unwrap().port()
        };
        let dir = std::env::temp_dir().join(format!(
            "dedupgate-pg-{}-{port}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).expect("make temp dir");
        let as_postgres = is_root();
        if as_postgres {
            let (uid, gid) = postgres_ids();
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).expect("chown temp dir");
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
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "-A",
                "trust",
                "--no-sync",
                "-E",
                "UTF8",
            ],
        );
        assert!(out.status.success(), "initdb failed: {}", text(&out));
        pg.pg_ctl_start();
        pg
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// A URL for the server's `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    fn run(&self, tool: &str, args: &[&str]) -> Output {
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
            .unwrap_or_else(|e| panic!("run {}: {e}", exe.display()))
    }

    fn pg_ctl_start(&self) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=on -c synchronous_commit=on \
             -c shared_buffers=16MB -c max_connections=60",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("server.log");
        // Right after a kill -9, orphaned backends may still hold the old shared memory for a
        // moment: the new postmaster refuses to start until they are gone, so retry.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let out = self.run(
                "pg_ctl",
                &[
                    "-D",
                    self.data().to_str().unwrap(),
                    "-o",
                    &opts,
                    "-l",
                    log.to_str().unwrap(),
                    "-w",
                    "-t",
                    "30",
                    "start",
                ],
            );
            if out.status.success() {
                return;
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&log).unwrap_or_default();
                panic!("pg_ctl start failed: {}\n{log}", text(&out));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    fn postmaster_pid(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.data().join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }

    /// kill -9 the postmaster (its backends notice and exit on their own).
    pub fn kill9(&self) {
        let pid = self.postmaster_pid().expect("a running postmaster");
        let status = Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -9 {pid} failed");
    }

    /// True while something accepts connections on the port.
    pub fn accepting(&self) -> bool {
        std::net::TcpStream::connect_timeout(
            &std::net::SocketAddr::from(([127, 0, 0, 1], self.port)),
            Duration::from_millis(200),
        )
        .is_ok()
    }

    /// True while any process of this cluster lives (the postmaster or a backend it left behind):
    /// every one of them runs with the data directory as its working directory.
    pub fn any_process_alive(&self) -> bool {
        let data = std::fs::canonicalize(self.data()).unwrap_or_else(|_| self.data());
        std::fs::read_dir("/proc")
            .map(|entries| {
                entries.flatten().any(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .bytes()
                        .all(|b| b.is_ascii_digit())
                        && std::fs::read_link(e.path().join("cwd")).is_ok_and(|cwd| cwd == data)
                })
            })
            .unwrap_or(false)
    }

    /// Starts the server again on the same data directory and port (crash recovery runs).
    pub fn restart(&self) {
        self.pg_ctl_start();
    }

    /// The directory, for messages.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

impl Drop for OwnedPg {
    fn drop(&mut self) {
        let _ = self.run(
            "pg_ctl",
            &[
                "-D",
                self.data().to_str().unwrap(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ],
        );
        // Only if stop failed and the pid file still names OUR postmaster (never a reused pid).
        if let Some(pid) = self.postmaster_pid() {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let ours = String::from_utf8_lossy(&cmdline).contains(&*self.dir.to_string_lossy());
            if ours {
                let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
