//! The "Exit status:" section of each subcommand's `--help`, in one place so the codes are
//! read side by side; the same codes are tabled in docs/cli.md, and tests/cli_help.rs checks
//! the two against each other.

/// `serve` and `proxy`.
pub const SERVE: &str = "\
Exit status:
  0      stopped by SIGINT or SIGTERM, after the requests in flight were answered
  1      could not start (address in use, store, config file, a bad flag value) or failed
  2      usage error (an unknown flag, a missing value)";

/// `relay` (a build without `relay` has no relay subcommand).
#[cfg_attr(not(feature = "relay"), allow(dead_code))]
pub const RELAY: &str = "\
Source and sink URLs:
  kafka://HOST:PORT[,HOST:PORT]/TOPIC?group=G      source: a consumer group of TOPIC
  kafka://HOST:PORT/TOPIC                          sink: idempotent producer, key = gate key
  amqp://USER:PASS@HOST:PORT/VHOST?queue=Q         source: a RabbitMQ queue
  amqp://…/VHOST?exchange=X&routing_key=K          sink: publish with confirms
  nats://HOST:PORT/STREAM?consumer=C               source: a JetStream durable pull consumer
  nats://HOST:PORT/SUBJECT                         sink: JetStream, Nats-Msg-Id = gate key
  stdout:   file:PATH                              sinks: JSON lines (file: fsync'd)
  http://HOST:PORT/PATH   https://…               sink: webhook POST, Idempotency-Key, Dedupgate-Fence
  postgres://USER@HOST:PORT/DB?table=T             sink: upsert by key, stale versions refused
The source is acked or committed only after the sink confirmed (docs/relay.md).

Exit status:
  0      stopped by SIGINT or SIGTERM, after the deliveries in hand settled
  1      could not start (a bad URL or route, store, broker unreachable) or a route failed
  2      usage error (an unknown flag, a missing value)";

/// `bench` (a build without `http-client` has no bench; its help is still checked).
#[cfg_attr(not(feature = "http-client"), allow(dead_code))]
pub const BENCH: &str = "\
Exit status:
  0      every request was answered
  1      some requests failed, or the bench could not run (server not reachable)
  2      usage error (an unknown flag, a missing value)";

/// `run`.
pub const RUN: &str = "\
Exit status:
  CMD    CMD ran: its own status (128+N when signal N ended it)
  0      skipped: the key is held or already completed (--skip-exit-code N to change it)
  125    the gate failed: store unreachable, bad key or flags, or CMD succeeded but its
         completion was not recorded (a later trigger may run it again)
  126    CMD exists but could not be executed
  127    CMD was not found
  128+N  signal N stopped run before CMD started (CMD never ran; the key was given back)
  2      usage error (no --, an unknown flag)";

/// `dedup`.
pub const DEDUP: &str = "\
Exit status:
  0      done (also when a reader closes stdout early)
  1      failed: a bad record without --rejects, a missing or unreadable input, I/O, the
         ledger
  2      usage error: no key option or a bad one, mixed formats without --format, a bad
         --namespace/--ledger/--ttl, an output naming an input
  130    stopped by SIGINT (Ctrl-C) after writing and recording what it had read";

/// `id`.
pub const ID: &str = "\
Exit status:
  0      done (also when a reader closes stdout early)
  1      failed: a record without a key field and no --rejects, a missing or unreadable
         input, I/O
  2      usage error: a bad --key-fields, mixed formats without --format, an output naming
         an input
  130    stopped by SIGINT (Ctrl-C)";

/// `audit`.
pub const AUDIT: &str = "\
Exit status:
  0      no duplicates (with --against: nothing over the source)
  1      duplicates found (with --against: keys or windows over the source)
  2      the audit could not be done: bad flags, an unreadable input, a database error
  130    stopped by SIGINT (Ctrl-C)";

/// `claim` and `mark`.
pub const CLAIM: &str = "\
Exit status:
  0      answered: new, or duplicate without -e (the JSON says which)
  1      the gate refused (fingerprint_mismatch, invalid_request, forbidden, ...)
  2      usage error (a missing or malformed --server/--store, a bad duration or --result)
  3      the gate could not be asked or gave no answer: the key's fate is not known; the
         call is safe to repeat
  4      with -e: the key is a duplicate (claimed or completed before)";

/// `complete`, `release`, `extend` and `forget`.
pub const API: &str = "\
Exit status:
  0      answered (completed, released, extended, deleted or not)
  1      the gate refused (lease_lost, invalid_request, forbidden, ...)
  2      usage error (a missing or malformed --server/--store, a bad duration or --result)
  3      the gate could not be asked or gave no answer: the key's fate is not known; the
         call is safe to repeat";

/// `get`.
pub const GET: &str = "\
Exit status:
  0      the key's live record, printed
  1      no live record for the key, or the gate refused
  2      usage error (a missing or malformed --server/--store)
  3      the gate could not be asked or gave no answer (never taken for \"no record\")";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::commands::{api, run};

    /// The codes a help text lists (the first word of each entry).
    fn codes(help: &str) -> Vec<String> {
        help.lines()
            .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .collect()
    }

    #[test]
    fn each_help_lists_the_codes_its_command_uses() {
        let has = |help: &str, code: u8| codes(help).contains(&code.to_string());
        for code in [
            run::EXIT_GATE_FAILED,
            run::EXIT_CANNOT_EXECUTE,
            run::EXIT_NOT_FOUND,
        ] {
            assert!(has(RUN, code), "run: {code}");
        }
        for help in [CLAIM, API, GET] {
            assert!(has(help, api::EXIT_NOT_DECIDED));
        }
        assert!(has(CLAIM, api::EXIT_DUPLICATE));
        assert!(!has(API, api::EXIT_DUPLICATE) && !has(GET, api::EXIT_DUPLICATE));
        for help in [DEDUP, ID, AUDIT] {
            assert!(has(help, crate::commands::pipeline::EXIT_INTERRUPTED));
        }
        for help in [SERVE, BENCH, RUN, DEDUP, ID, AUDIT, CLAIM, API, GET] {
            assert!(has(help, 2), "every command has clap's usage code");
        }
    }
}
