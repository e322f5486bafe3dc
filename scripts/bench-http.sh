#!/usr/bin/env bash
# HTTP benchmark of the gate beside Redis, in one run, on this machine (docs/benchmarks-http.md):
#   - dedupgate serve on the embedded durable store (fresh dir; every answer fdatasync'd before
#     it is sent): wrk single claims (scripts/wrk-claim.lua), wrk batches of BATCH claims
#     (scripts/wrk-batch.lua), then `dedupgate bench` single/batch (the repo's own Rust generator;
#     DEDUPGATE_BENCH=0 skips it),
#   - the same wrk runs against dedupgate serve on memory: (the HTTP face without the durable
#     commit, for attribution),
#   - redis-benchmark -c 50 -P 1 right before the single-claim run and -P 16 right before the
#     batch run, SET key:__rand_int__ 1 NX EX 86400 against the machine's Redis (db 15, emptied
#     before each run and afterwards), on fresh keys (-r 100000000) as every wrk claim is; and,
#     beside `dedupgate bench` (keys uniform in 0..1,000,000), on -r 1000000 as that generator,
#     where most SETs after the first million find their key (NX: nothing written),
#   - the same fresh-key redis-benchmark runs against a private redis-server made durable the
#     way the gate is (appendonly yes, appendfsync always: every answer fsync'd first; its AOF
#     on the same disk, in the run's directory), for reference (DURABLE_REDIS=0 skips them),
# then prints a markdown table with the ratios and the CPU each side used. Every wrk key is
# unique, so every answer must be a 200 "new"; a run with any other answer is marked INVALID and
# the script exits 1. wrk waits up to 10 s for an answer (the server's own request timeout).
# Usage: scripts/bench-http.sh [SECONDS] [CONNS] [BATCH]; WRK_THREADS (default 2) sets wrk -t.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
CONNS=${2:-50}
BATCH=${3:-100}
WRK_THREADS=${WRK_THREADS:-2}
DEDUPGATE_BENCH=${DEDUPGATE_BENCH:-1}
DURABLE_REDIS=${DURABLE_REDIS:-1}
REDIS_HOST=${REDIS_HOST:-127.0.0.1}
REDIS_PORT=${REDIS_PORT:-6379}
REDIS_DB=${REDIS_DB:-15}
command -v wrk >/dev/null || { echo "wrk is missing: apt-get install -y wrk" >&2; exit 1; }

cargo build --release -q -p dedupgate
BIN=target/release/dedupgate
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dedupgate-bench.XXXXXX")
RUN_ID=$(date +%s)-$$
SERVER=
DURABLE_PORT=
cleanup() {
  if [ -n "$DURABLE_PORT" ]; then redis-cli -p "$DURABLE_PORT" shutdown nosave >/dev/null 2>&1 || true; fi
  if [ -n "$SERVER" ]; then kill -TERM "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# CPU seconds (user+system) a process has used so far.
cpu_s() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.2f", ($14+$15)/hz}' "/proc/$1/stat"; }

start_server() { # $1 = store, $2 = log name; sets SERVER and URL
  local port; port=$(free_port)
  URL="http://127.0.0.1:$port"
  "$BIN" serve --listen "127.0.0.1:$port" --store "$1" --in-flight-max 4096 2>"$WORK/$2.log" &
  SERVER=$!
  for _ in $(seq 1 100); do curl -sf "$URL/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
  curl -sf "$URL/healthz" >/dev/null || { cat "$WORK/$2.log"; exit 1; }
}
stop_server() { kill -TERM "$SERVER"; wait "$SERVER" || true; SERVER=; }

wrk_run() { # $1 = name, $2 = lua script, then script args; writes $WORK/$1.json
  local name=$1 script=$2; shift 2
  local before; before=$(cpu_s "$SERVER")
  /usr/bin/time -f '%U %S' -o "$WORK/$name.time" \
    wrk -t "$WRK_THREADS" -c "$CONNS" -d "${SECS}s" --timeout 10s --latency -s "$script" "$URL" -- "$@" \
    > "$WORK/$name.out"
  local after; after=$(cpu_s "$SERVER")
  sed 's/^/    /' "$WORK/$name.out" >&2
  python3 - "$WORK" "$name" "$before" "$after" <<'PY'
import json, sys
work, name, before, after = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
line = next(l for l in open(f"{work}/{name}.out") if l.startswith("WRK_RESULT "))
r = json.loads(line[len("WRK_RESULT "):])
secs = r["duration_us"] / 1e6
user, sys_ = map(float, open(f"{work}/{name}.time").read().split()[-2:])
out = {
    "ops_per_s": r["requests"] * r["ops_per_request"] / secs,
    "requests_per_s": r["requests"] / secs,
    "p50_ms": r["p50_us"] / 1000, "p99_ms": r["p99_us"] / 1000,
    "errors": r["non2xx"] + r["bad_items"] + r["socket_errors"],
    "error_detail": f'{r["non2xx"]} non-2xx, {r["bad_items"]} items not new, {r["socket_errors"]} socket errors',
    "server_cores": (after - before) / secs, "gen_cores": (user + sys_) / secs,
}
json.dump(out, open(f"{work}/{name}.json", "w"))
PY
}

bench_run() { # $1 = name, then dedupgate bench args; writes $WORK/$1.json
  local name=$1; shift
  local before; before=$(cpu_s "$SERVER")
  /usr/bin/time -f '%U %S' -o "$WORK/$name.time" \
    "$BIN" bench --server "$URL" -c "$CONNS" --duration "${SECS}s" --json "$@" > "$WORK/$name.raw"
  local after; after=$(cpu_s "$SERVER")
  python3 - "$WORK" "$name" "$before" "$after" "$SECS" <<'PY'
import json, sys
work, name, before, after, secs = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
r = json.load(open(f"{work}/{name}.raw"))
user, sys_ = map(float, open(f"{work}/{name}.time").read().split()[-2:])
json.dump({"ops_per_s": r["ops_per_s"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
           "errors": r["requests_failed"], "error_detail": f'{r["requests_failed"]} failed requests',
           "server_cores": (after - before) / secs, "gen_cores": (user + sys_) / secs},
          open(f"{work}/{name}.json", "w"))
PY
}

echo "# $(date -u +%FT%TZ) $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg); wrk -t$WRK_THREADS -c$CONNS, ${SECS}s per run, batch $BATCH" >&2
# Redis beside each gate run, so a pair is measured within seconds of each other on a machine
# whose load moves: about SECS seconds of requests at the rates of an idle run.
redis_pid() { redis-cli -h "$REDIS_HOST" -p "$1" info server | tr -d '\r' | sed -n 's/^process_id://p'; }
REDIS_PID=$(redis_pid "$REDIS_PORT")
redis_flush() { redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" -n "$REDIS_DB" flushdb >/dev/null; }
# $1 = name, $2 = pipeline depth, $3 = requests, $4 = key range (-r); REDIS_PORT, REDIS_DB and
# REDIS_PID say which server (the machine's unless set for the call).
redis_run() {
  local before after start end
  redis_flush
  before=$(cpu_s "$REDIS_PID"); start=$(date +%s.%N)
  /usr/bin/time -f '%U %S' -o "$WORK/$1.time" \
    redis-benchmark -h "$REDIS_HOST" -p "$REDIS_PORT" --dbnum "$REDIS_DB" -c 50 -P "$2" \
    -n "$3" -r "$4" --csv SET key:__rand_int__ 1 NX EX 86400 | tail -n1 > "$WORK/$1.csv"
  after=$(cpu_s "$REDIS_PID"); end=$(date +%s.%N)
  python3 - "$WORK" "$1" "$before" "$after" "$start" "$end" <<'PY'
import csv, json, sys
work, name = sys.argv[1], sys.argv[2]
before, after, start, end = map(float, sys.argv[3:7])
# "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
row = next(csv.reader(open(f"{work}/{name}.csv")))
user, sys_ = map(float, open(f"{work}/{name}.time").read().split()[-2:])
secs = end - start
json.dump({"ops_per_s": float(row[1]), "p50_ms": float(row[4]), "p99_ms": float(row[6]),
           "errors": 0, "error_detail": "", "server_cores": (after - before) / secs,
           "gen_cores": (user + sys_) / secs}, open(f"{work}/{name}.json", "w"))
PY
}
start_server "embedded:$WORK/data" serve
echo "# $(head -n1 "$WORK/serve.log" | sed 's/.*listening/listening/')" >&2
# Fresh keys on both sides: every wrk claim is a new key, and so is (almost) every SET.
redis_run redis1 1 $((70000 * SECS)) 100000000
wrk_run emb-single scripts/wrk-claim.lua "$RUN_ID-es"
redis_run redis16 16 $((350000 * SECS)) 100000000
wrk_run emb-batch scripts/wrk-batch.lua "$RUN_ID-eb" "$BATCH"
if [ "$DEDUPGATE_BENCH" = 1 ]; then
  # Keys uniform in 0..1,000,000 on both sides (mostly duplicates once the first million came).
  redis_run redis1-r1m 1 $((70000 * SECS)) 1000000
  bench_run bench-single --mode single
  redis_run redis16-r1m 16 $((350000 * SECS)) 1000000
  bench_run bench-batch --mode batch --batch-size "$BATCH"
fi
stop_server
redis_flush

if [ "$DURABLE_REDIS" = 1 ]; then
  DURABLE_PORT=$(free_port)
  mkdir -p "$WORK/aof"
  redis-server --port "$DURABLE_PORT" --bind 127.0.0.1 --daemonize yes --save "" \
    --appendonly yes --appendfsync always --dir "$WORK/aof" --logfile "$WORK/aof/redis.log"
  for _ in $(seq 1 50); do redis-cli -p "$DURABLE_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
  durable_run() { REDIS_PORT=$DURABLE_PORT REDIS_DB=0 REDIS_PID=$(redis_pid "$DURABLE_PORT") redis_run "$@"; }
  durable_run aof1 1 $((50000 * SECS)) 100000000
  durable_run aof16 16 $((200000 * SECS)) 100000000
  redis-cli -p "$DURABLE_PORT" shutdown nosave >/dev/null 2>&1 || true
  DURABLE_PORT=
fi

start_server memory: serve-mem
wrk_run mem-single scripts/wrk-claim.lua "$RUN_ID-ms"
wrk_run mem-batch scripts/wrk-batch.lua "$RUN_ID-mb" "$BATCH"
stop_server

echo "# done $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2

python3 - "$WORK" "$CONNS" "$BATCH" "$WRK_THREADS" "$DEDUPGATE_BENCH" "$DURABLE_REDIS" <<'PY'
import json, os, sys
work, conns, batch, threads, with_bench, with_durable = sys.argv[1:7]
load = lambda n: json.load(open(f"{work}/{n}.json"))
r1, r16 = load("redis1"), load("redis16")
durable = {"-P 1": load("aof1"), "-P 16": load("aof16")} if with_durable == "1" else {}
rows = [
    ("redis-benchmark -c 50 -P 1 (SET NX EX), fresh keys", r1, None, ""),
    ("redis-benchmark -c 50 -P 16 (SET NX EX), fresh keys", r16, None, ""),
    (f"wrk -t{threads} -c{conns}: HTTP single claim, embedded, fresh keys", load("emb-single"), ("-P 1", r1), ">= 0.5x, p99 < 5 ms", True),
    (f"wrk -t{threads} -c{conns}: HTTP batch of {batch} claims, embedded, fresh keys", load("emb-batch"), ("-P 16", r16), ">= 1x", True),
]
if with_bench == "1":
    r1m1, r1m16 = load("redis1-r1m"), load("redis16-r1m")
    rows += [
        ("redis-benchmark -c 50 -P 1 (SET NX EX), keys in 0..1M", r1m1, None, ""),
        ("redis-benchmark -c 50 -P 16 (SET NX EX), keys in 0..1M", r1m16, None, ""),
        (f"dedupgate bench -c {conns}: single claim, embedded, keys in 0..1M", load("bench-single"), ("-P 1 (0..1M)", r1m1), ">= 0.5x"),
        (f"dedupgate bench -c {conns}: batch of {batch}, embedded, keys in 0..1M", load("bench-batch"), ("-P 16 (0..1M)", r1m16), ">= 1x"),
    ]
if durable:
    rows += [
        ("durable redis-server (appendfsync always) -c 50 -P 1, fresh keys", durable["-P 1"], ("-P 1", r1), "reference"),
        ("durable redis-server (appendfsync always) -c 50 -P 16, fresh keys", durable["-P 16"], ("-P 16", r16), "reference"),
    ]
rows += [
    (f"wrk -t{threads} -c{conns}: single claim, memory store (not durable)", load("mem-single"), ("-P 1", r1), "attribution only"),
    (f"wrk -t{threads} -c{conns}: batch of {batch}, memory store (not durable)", load("mem-batch"), ("-P 16", r16), "attribution only"),
]
print("| run | claims/s | p50 ms | p99 ms | server CPU (cores) | server CPU µs/claim | load generator CPU (cores) | ratio | target |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
invalid = []
for name, r, base, target, *beside_durable in rows:
    ratio = f"{r['ops_per_s'] / base[1]['ops_per_s']:.2f}x of {base[0]}" if base else "1.00"
    if durable and beside_durable:
        ratio += f"; {r['ops_per_s'] / durable[base[0]]['ops_per_s']:.2f}x of durable {base[0]}"
    if r["errors"]:
        invalid.append(f"{name}: {r['error_detail']}")
        ratio += " INVALID"
    print(f"| {name} | {r['ops_per_s']:,.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
          f"{r['server_cores']:.2f} | {r['server_cores'] / r['ops_per_s'] * 1e6:.1f} | {r['gen_cores']:.2f} | {ratio} | {target} |")
print()
for line in invalid:
    print(f"INVALID: {line}")
sys.exit(1 if invalid else 0)
PY
