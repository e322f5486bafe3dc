#!/usr/bin/env bash
# Soak tier of the torture harness (issue 7): crash cycles on every store and face, checked
# linearizability histories on every store, then the fuzz targets; prints the summed figures
# that docs/reliability.md publishes.
#
#   scripts/torture.sh --minutes 60 [--fuzz-seconds 3600] [--out DIR] [--cycles-per-run 100]
#                      [--only REGEX]
#
# --only runs just the runs whose label matches REGEX (e.g. 'embedded|proxy'); --fuzz-seconds 0
# skips the fuzz step.
# Needs the local Redis (127.0.0.1:6379) and PostgreSQL (127.0.0.1:5432, user postgres, db test)
# the tests use (DEDUPGATE_TEST_REDIS_URL / DEDUPGATE_TEST_POSTGRES_URL override them), and
# fiu-utils, faketime and cc for the storage-fault and clock-jump runs: before any run it installs
# whatever of these is missing, as scripts/test.sh does (Debian/Ubuntu apt, as root or through
# sudo), and stops at once if it cannot. The fuzz
# step needs a nightly toolchain and cargo-fuzz; it is skipped, and says so, without them.
# Every run prints its seed; a failing run keeps its directory under OUT and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."

minutes=10
fuzz_seconds=60
only=""
cycles=100
out="${TMPDIR:-/tmp}/dedupgate-soak-$(date -u +%Y%m%dT%H%M%SZ)"
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) minutes="$2"; shift 2 ;;
    --fuzz-seconds) fuzz_seconds="$2"; shift 2 ;;
    --cycles-per-run) cycles="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set /p' "$0" | grep '^#'; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
redis="${DEDUPGATE_TEST_REDIS_URL:-redis://127.0.0.1:6379}"
pg="${DEDUPGATE_TEST_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}"
mkdir -p "$out"
report="$out/reports.jsonl"

# Once, before any run: without fiu-utils and faketime every storage-fault and clock-jump run
# would fail on its own, each saying a library is missing.
if ! scripts/test.sh --install-only; then
  echo "scripts/torture.sh: cannot install what the soak needs (redis-server, PostgreSQL, fiu-utils, faketime, a C compiler); install them and run again" >&2
  exit 2
fi
cargo build -q -p dedupgate-torture -p dedupgate
bin="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug/dedupgate-torture"
# The storage-fault and clock-jump runs put the shipped `dedupgate serve` under their injectors.
export DEDUPGATE_BIN="${bin%-torture}"

failed=0
run() { # label, args...
  local label="$1"; shift
  # --only REGEX: run just the rounds' runs whose label matches (e.g. to re-soak one store).
  if [ -n "$only" ] && ! [[ "$label" =~ $only ]]; then return 0; fi
  echo "=== $label"
  if ! "$bin" "$@" --report "$report"; then
    echo "!!! $label FAILED (files kept under $out)"; failed=1
  fi
}

deadline=$(( $(date +%s) + minutes * 60 ))
n=0
while [ "$(date +%s)" -lt "$deadline" ]; do
  n=$((n + 1))
  run "memory over http #$n" run --store memory: --face http --cycles "$cycles" \
    --dir "$out/mem-$n" --clean
  run "embedded over http, gate SIGKILLs #$n" run --store "embedded:$out/emb-$n/data" --face http \
    --cycles "$cycles" --kill-gate-pct 30 --dir "$out/emb-$n/run" --clean
  [ -d "$out/emb-$n/run" ] || rm -rf "$out/emb-$n"
  run "redis over library #$n" run --store "$redis" --face library --cycles "$cycles" \
    --dir "$out/redis-$n" --clean
  run "postgres over library #$n" run --store "$pg" --face library --cycles "$cycles" \
    --dir "$out/pg-$n" --clean
  run "redis over library, TCP faults #$n" run --store "$redis" --face library --cycles "$cycles" \
    --tcp-faults --tcp-cut-all-pct 20 --dir "$out/redis-tcp-$n" --clean
  run "postgres over library, TCP faults #$n" run --store "$pg" --face library --cycles "$cycles" \
    --tcp-faults --tcp-cut-all-pct 20 --dir "$out/pg-tcp-$n" --clean
  run "redis over http, TCP faults #$n" run --store "$redis" --face http --cycles "$cycles" \
    --tcp-faults --tcp-cut-all-pct 20 --dir "$out/redis-http-tcp-$n" --clean
  run "owned redis over library, SIGKILL and restart, TCP faults #$n" run --face library \
    --cycles "$cycles" --kill-owned-redis-pct 20 --tcp-faults --tcp-cut-all-pct 10 \
    --dir "$out/redis-own-$n" --clean
  run "owned postgres over library, kill -9 and restart #$n" run --face library --cycles "$cycles" \
    --kill-owned-postgres-pct 10 --dir "$out/pg-own-$n" --clean
  run "dedupgate run over redis, run SIGKILLs #$n" run --store "$redis" --face cron \
    --cycles "$cycles" --kill-gate-pct 30 --dir "$out/cron-redis-$n" --clean
  run "dedupgate run over postgres, TCP faults #$n" run --store "$pg" --face cron --cycles "$cycles" \
    --kill-gate-pct 30 --tcp-faults --tcp-cut-all-pct 20 --dir "$out/cron-pg-$n" --clean
  run "dedupgate proxy over embedded, proxy SIGKILLs #$n" run --store "embedded:$out/px-emb-$n/data" \
    --face proxy --cycles "$cycles" --kill-gate-pct 30 --dir "$out/px-emb-$n/run" --clean
  [ -d "$out/px-emb-$n/run" ] || rm -rf "$out/px-emb-$n"
  run "dedupgate proxy over redis, TCP faults #$n" run --store "$redis" --face proxy \
    --cycles "$cycles" --kill-gate-pct 25 --tcp-faults --tcp-cut-all-pct 20 --dir "$out/px-redis-$n" --clean
  run "failed writes and fsyncs, then a power loss, embedded over http #$n" storage-faults \
    --kind failed-io --then-power-loss --episodes 20 --dir "$out/fiu-$n" --clean
  run "power loss, embedded over http #$n" storage-faults --kind power-loss --episodes 20 \
    --dir "$out/loss-$n" --clean
  run "clock jumps, redis over http #$n" clock-jumps --store "$redis" --jumps 40 \
    --dir "$out/clock-redis-$n" --clean
  run "clock jumps, postgres over http #$n" clock-jumps --store "$pg" --jumps 40 \
    --dir "$out/clock-pg-$n" --clean
  run "clock jumps back, embedded over http #$n" clock-jumps --store "embedded:$out/clock-emb-$n/data" \
    --jumps 40 --dir "$out/clock-emb-$n/run" --clean
  [ -d "$out/clock-emb-$n/run" ] || rm -rf "$out/clock-emb-$n"
  run "lin memory #$n" lin --store memory: --histories 10
  run "lin embedded #$n" lin --store "embedded:$out/lin-emb-$n" --histories 10
  rm -rf "$out/lin-emb-$n"
  run "lin redis #$n" lin --store "$redis" --histories 10
  run "lin postgres #$n" lin --store "$pg" --histories 10
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  "$bin" gate --store memory: --listen "127.0.0.1:$port" >"$out/lin-gate.log" 2>&1 &
  gate=$!
  for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
  run "lin http #$n" lin --store "http://127.0.0.1:$port" --histories 10
  kill "$gate"; wait "$gate" 2>/dev/null || true
done

echo "=== fuzz ($fuzz_seconds s per target)"
if [ "$fuzz_seconds" -eq 0 ]; then
  echo "fuzz: skipped (--fuzz-seconds 0)"
elif cargo +nightly --version >/dev/null 2>&1 && cargo fuzz --version >/dev/null 2>&1; then
  for t in http_body key_template id_canonical embedded_record; do
    (cd fuzz && cargo +nightly fuzz run "$t" -O -- -max_total_time="$fuzz_seconds" 2>&1 \
      | grep -E "^Done|ERROR|SUMMARY" | sed "s/^/fuzz $t: /") || failed=1
    ls fuzz/artifacts/"$t"/ 2>/dev/null | grep -q . && { echo "!!! fuzz $t left a crash in fuzz/artifacts/$t"; failed=1; }
  done
else
  echo "fuzz: skipped (needs a nightly toolchain and cargo-fuzz: cargo install cargo-fuzz)"
fi

echo "=== summary ($n rounds, reports in $report)"
"$bin" summarize "$report"
exit "$failed"
