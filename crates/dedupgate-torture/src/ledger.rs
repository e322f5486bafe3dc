//! The oracle's evidence, kept outside the gate in plain files of the run directory:
//!
//! - [`Sink`]: the downstream system the workers' side effects land in. It checks fences: a
//!   write whose fence is lower than the highest it has accepted for that event is a late write
//!   from a stale holder and is rejected. Every write, accepted or not, is appended to the
//!   effect ledger (`effects.jsonl`) and fsync'd before the writer is told, so the ledger holds
//!   every effect that ever ran, whatever crashed after.
//! - [`AnswerLog`]: one file per worker process (`answers-*.jsonl`): a `call` line written
//!   before each request is sent and a `ret` line when its answer arrives. A call without a
//!   `ret` (the process was killed) is an unknown outcome. [`read_answer_logs`] turns the files
//!   back into a history for the checkers.
//!
//! Both survive SIGKILL of their writer: a line is one `write(2)` to an `O_APPEND` file, and a
//! torn last line (a kill inside the write) is skipped on reading.

use std::fs::{File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rustix::fs::{flock, FlockOperation};
use serde::{Deserialize, Serialize};

use crate::history::{wall_ns, Event, HAnswer, HOp};

/// One write that reached the sink.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Effect {
    /// Namespace of the event's key.
    pub namespace: String,
    /// The event's key.
    pub key: String,
    /// The fence the writer presented.
    pub fence: u64,
    /// The attempt that wrote (unique per claim or mark a worker made).
    pub attempt: String,
    /// Which worker process.
    pub worker: String,
    /// Wall-clock ns of the write.
    pub effect_ns: u64,
    /// The writer's lease end as the gate last told it (retriable), if any.
    pub lease_expires_at_ms: Option<u64>,
    /// False when the sink refused it as late (a higher fence was already accepted).
    pub accepted: bool,
    /// The highest fence accepted for the event before this write.
    pub fence_before: u64,
}

/// The fence-checking sink and the effect ledger behind it. Cheap to share across tasks;
/// safe to use from many processes at once (per-event `flock`).
#[derive(Debug)]
pub struct Sink {
    fences_dir: PathBuf,
    ledger: File,
}

fn file_name_for(namespace: &str, key: &str) -> String {
    let safe: String = format!("{namespace}__{key}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(150)
        .collect();
    // FNV-1a keeps names of different ids apart after the replacement above; stable everywhere.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in namespace.bytes().chain([0]).chain(key.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{safe}.{h:016x}")
}

impl Sink {
    /// Opens (creating) the sink under `run_dir`.
    pub fn open(run_dir: &Path) -> io::Result<Self> {
        let fences_dir = run_dir.join("fences");
        std::fs::create_dir_all(&fences_dir)?;
        let ledger = OpenOptions::new()
            .create(true)
            .append(true)
            .open(run_dir.join("effects.jsonl"))?;
        Ok(Self { fences_dir, ledger })
    }

    /// Writes one effect for (namespace, key) with `fence`. Returns whether it was accepted.
    /// The ledger line is on disk (fsync'd) before this returns.
    pub fn write(
        &self,
        namespace: &str,
        key: &str,
        fence: u64,
        attempt: &str,
        worker: &str,
        lease_expires_at_ms: Option<u64>,
    ) -> io::Result<bool> {
        let fence_file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(self.fences_dir.join(file_name_for(namespace, key)))?;
        flock(&fence_file, FlockOperation::LockExclusive)?;
        // Fixed width, written in place with one pwrite: never torn, never truncated.
        let mut buf = [0u8; 21];
        let n = fence_file.read_at(&mut buf, 0)?;
        let fence_before: u64 = std::str::from_utf8(&buf[..n])
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        let accepted = fence >= fence_before;
        if accepted && fence > fence_before {
            fence_file.write_all_at(format!("{fence:020}\n").as_bytes(), 0)?;
            fence_file.sync_data()?;
        }
        let effect = Effect {
            namespace: namespace.to_owned(),
            key: key.to_owned(),
            fence,
            attempt: attempt.to_owned(),
            worker: worker.to_owned(),
            effect_ns: wall_ns(),
            lease_expires_at_ms,
            accepted,
            fence_before,
        };
        let mut line = serde_json::to_vec(&effect).map_err(io::Error::other)?;
        line.push(b'\n');
        (&self.ledger).write_all(&line)?;
        self.ledger.sync_data()?;
        // The lock goes with the file.
        Ok(accepted)
    }
}

/// Reads the effect ledger of a run (a torn last line is skipped).
pub fn read_ledger(run_dir: &Path) -> io::Result<Vec<Effect>> {
    let path = run_dir.join("effects.jsonl");
    if !path.exists() {
        return Ok(vec![]);
    }
    read_jsonl(&path)
}

fn read_jsonl<T: for<'de> Deserialize<'de>>(path: &Path) -> io::Result<Vec<T>> {
    let mut out = Vec::new();
    for line in BufReader::new(File::open(path)?).lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        // Only a process killed inside its last write leaves a bad line, and only at the end.
        if let Ok(v) = serde_json::from_str(&line) {
            out.push(v);
        }
    }
    Ok(out)
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
enum LogLine {
    Call {
        seq: u64,
        namespace: String,
        key: String,
        op: HOp,
        call_ns: u64,
    },
    Ret {
        seq: u64,
        answer: HAnswer,
        return_ns: Option<u64>,
    },
}

/// An append-only JSON-lines log, one `write(2)` per line, so a killed writer leaves at most
/// one torn line at the end (the answer, cron and proxy-face logs all are one).
#[derive(Debug)]
pub(crate) struct JsonlLog {
    file: File,
}

impl JsonlLog {
    /// Opens (creating) `<prefix>-<worker>.jsonl` in `run_dir` for appending.
    pub(crate) fn create(run_dir: &Path, prefix: &str, worker: &str) -> io::Result<Self> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(run_dir.join(format!("{prefix}-{worker}.jsonl")))?;
        Ok(Self { file })
    }

    /// Every `<prefix>-*.jsonl` in `run_dir`, sorted by name.
    pub(crate) fn list(run_dir: &Path, prefix: &str) -> io::Result<Vec<PathBuf>> {
        let start = format!("{prefix}-");
        let mut names: Vec<PathBuf> = std::fs::read_dir(run_dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&start) && n.ends_with(".jsonl"))
            })
            .collect();
        names.sort();
        Ok(names)
    }

    /// Appends `l` as one line.
    pub(crate) fn line<T: Serialize>(&mut self, l: &T) -> io::Result<()> {
        let mut v = serde_json::to_vec(l).map_err(io::Error::other)?;
        v.push(b'\n');
        self.file.write_all(&v)
    }
}

/// The log of every gate answer one worker process got.
#[derive(Debug)]
pub struct AnswerLog {
    file: JsonlLog,
    seq: u64,
}

impl AnswerLog {
    /// Creates `answers-<client>.jsonl` in `run_dir`.
    pub fn create(run_dir: &Path, client: &str) -> io::Result<Self> {
        let file = JsonlLog::create(run_dir, "answers", client)?;
        Ok(Self { file, seq: 0 })
    }

    fn line(&mut self, l: &LogLine) -> io::Result<()> {
        self.file.line(l)
    }

    /// Logs a call about to be sent; returns its sequence number.
    pub fn call(&mut self, namespace: &str, key: &str, op: &HOp, call_ns: u64) -> io::Result<u64> {
        self.seq += 1;
        let seq = self.seq;
        self.line(&LogLine::Call {
            seq,
            namespace: namespace.to_owned(),
            key: key.to_owned(),
            op: op.clone(),
            call_ns,
        })?;
        Ok(seq)
    }

    /// Logs the answer to call `seq`.
    pub fn ret(&mut self, seq: u64, answer: &HAnswer, return_ns: Option<u64>) -> io::Result<()> {
        self.line(&LogLine::Ret {
            seq,
            answer: answer.clone(),
            return_ns,
        })
    }
}

/// Every call logged in `run_dir`'s answer logs, as one history. A call with no answer line
/// (its process was killed) is unknown.
pub fn read_answer_logs(run_dir: &Path) -> io::Result<Vec<Event>> {
    let mut events = Vec::new();
    let names = JsonlLog::list(run_dir, "answers")?;
    for path in names {
        let client = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("?")
            .trim_start_matches("answers-")
            .to_owned();
        let lines: Vec<LogLine> = read_jsonl(&path)?;
        let mut calls: std::collections::BTreeMap<u64, Event> = Default::default();
        for l in lines {
            match l {
                LogLine::Call {
                    seq,
                    namespace,
                    key,
                    op,
                    call_ns,
                } => {
                    calls.insert(
                        seq,
                        Event {
                            client: client.clone(),
                            namespace,
                            key,
                            op,
                            call_ns,
                            return_ns: None,
                            answer: HAnswer::Unknown {
                                why: "no answer logged: the process was killed".into(),
                            },
                        },
                    );
                }
                LogLine::Ret {
                    seq,
                    answer,
                    return_ns,
                } => {
                    if let Some(e) = calls.get_mut(&seq) {
                        e.answer = answer;
                        e.return_ns = return_ns;
                    }
                }
            }
        }
        events.extend(calls.into_values());
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sink_refuses_a_lower_fence_and_logs_both() {
        let dir = tempfile::tempdir().unwrap();
        let sink = Sink::open(dir.path()).unwrap();
        assert!(sink.write("ns", "k", 20, "b#1", "b", Some(5)).unwrap());
        assert!(!sink.write("ns", "k", 10, "a#1", "a", Some(3)).unwrap());
        // Another key has its own fence; a new sink (another process) sees the stored one.
        assert!(sink.write("ns", "other", 1, "c#1", "c", None).unwrap());
        let again = Sink::open(dir.path()).unwrap();
        assert!(!again.write("ns", "k", 19, "d#1", "d", None).unwrap());
        let ledger = read_ledger(dir.path()).unwrap();
        let accepted: Vec<bool> = ledger.iter().map(|e| e.accepted).collect();
        assert_eq!(accepted, [true, false, true, false]);
        assert_eq!(ledger[1].fence_before, 20);
    }

    #[test]
    fn a_call_without_its_answer_is_unknown_and_a_torn_line_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = AnswerLog::create(dir.path(), "w1").unwrap();
        let s1 = log.call("ns", "k", &HOp::Get, 1).unwrap();
        log.ret(s1, &HAnswer::Found { record: None }, Some(2))
            .unwrap();
        log.call("ns", "k", &HOp::Get, 3).unwrap();
        drop(log);
        // A kill inside a write leaves half a line at the end.
        let mut f = OpenOptions::new()
            .append(true)
            .open(dir.path().join("answers-w1.jsonl"))
            .unwrap();
        f.write_all(b"{\"t\":\"ret\",\"seq\":2,\"ans").unwrap();
        let events = read_answer_logs(dir.path()).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].answer, HAnswer::Found { record: None });
        assert!(events[1].answer.is_unknown());
        assert_eq!(events[1].return_ns, None);
        assert_eq!(events[1].client, "w1");
    }
}
