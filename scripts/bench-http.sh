#!/usr/bin/env bash
# HTTP benchmark of the gate beside Redis, in one run, on this machine:
#   - dedupgate serve on the embedded durable store (every answer fsync'd before it is sent),
#   - dedupgate bench: N keep-alive connections, single claims, then batches of claims,
#   - redis-benchmark -c 50 -P 1 and -P 16 for SET key:__rand_int__ 1 NX EX 86400 -r 1000000
#     against the machine's Redis (db 15, its keys removed afterwards),
# and prints a markdown table with the ratios. Usage: scripts/bench-http.sh [SECONDS] [CONNS] [BATCH]
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-10}
CONNS=${2:-50}
BATCH=${3:-100}
REDIS_HOST=${REDIS_HOST:-127.0.0.1}
REDIS_PORT=${REDIS_PORT:-6379}
REDIS_DB=${REDIS_DB:-15}

cargo build --release -q -p dedupgate
BIN=target/release/dedupgate
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dedupgate-bench.XXXXXX")
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
URL="http://127.0.0.1:$PORT"
"$BIN" serve --listen "127.0.0.1:$PORT" --store "embedded:$WORK/data" --in-flight-max 4096 \
  2>"$WORK/serve.log" &
SERVER=$!
cleanup() {
  kill -TERM "$SERVER" 2>/dev/null || true
  wait "$SERVER" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
for _ in $(seq 1 100); do curl -sf "$URL/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
curl -sf "$URL/healthz" >/dev/null || { cat "$WORK/serve.log"; exit 1; }

echo "# $(date -u +%FT%TZ) $(nproc) cores; server: $(head -n1 "$WORK/serve.log" | sed 's/.*listening/listening/')" >&2
echo "# dedupgate bench: $CONNS connections, ${SECS}s per mode, batch $BATCH" >&2
"$BIN" bench --server "$URL" -c "$CONNS" --duration "${SECS}s" --mode single --json > "$WORK/single.json"
"$BIN" bench --server "$URL" -c "$CONNS" --duration "${SECS}s" --mode batch --batch-size "$BATCH" --json > "$WORK/batch.json"

# The same load on the memory store: what the HTTP face costs without a durable commit.
MPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN" serve --listen "127.0.0.1:$MPORT" --store memory: --in-flight-max 4096 2>"$WORK/serve-mem.log" &
MSERVER=$!
for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$MPORT/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
"$BIN" bench --server "http://127.0.0.1:$MPORT" -c "$CONNS" --duration "${SECS}s" --mode single --json > "$WORK/mem-single.json"
"$BIN" bench --server "http://127.0.0.1:$MPORT" -c "$CONNS" --duration "${SECS}s" --mode batch --batch-size "$BATCH" --json > "$WORK/mem-batch.json"
kill -TERM "$MSERVER"; wait "$MSERVER" || true

# Redis: about as many requests as the HTTP run sent per mode, at least 200k.
redis_run() { # $1 = pipeline depth
  redis-benchmark -h "$REDIS_HOST" -p "$REDIS_PORT" --dbnum "$REDIS_DB" -c 50 -P "$1" \
    -n "$2" -r 1000000 --csv SET key:__rand_int__ 1 NX EX 86400 | tail -n1
}
N1=$(python3 -c "import json; print(max(200000, int(json.load(open('$WORK/single.json'))['ops_per_s']*$SECS)))")
redis_run 1 "$N1" > "$WORK/redis1.csv"
redis_run 16 $((N1 * 4)) > "$WORK/redis16.csv"
redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" -n "$REDIS_DB" --scan --pattern 'key:*' \
  | xargs -r -n 10000 redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" -n "$REDIS_DB" unlink >/dev/null || true

python3 - "$WORK" "$CONNS" "$BATCH" <<'PY'
import csv, json, sys
work, conns, batch = sys.argv[1], sys.argv[2], sys.argv[3]
single = json.load(open(f"{work}/single.json"))
batched = json.load(open(f"{work}/batch.json"))
def redis(path):
    row = next(csv.reader(open(path)))
    # "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
    return {"ops_per_s": float(row[1]), "p50_ms": float(row[4]), "p99_ms": float(row[6])}
r1, r16 = redis(f"{work}/redis1.csv"), redis(f"{work}/redis16.csv")
print(f"| run | claims/s | p50 ms | p99 ms | ratio | target |")
print(f"|---|---:|---:|---:|---:|---|")
print(f"| redis-benchmark -c 50 -P 1 (SET NX EX) | {r1['ops_per_s']:,.0f} | {r1['p50_ms']:.3f} | {r1['p99_ms']:.3f} | 1.00 | |")
print(f"| redis-benchmark -c 50 -P 16 (SET NX EX) | {r16['ops_per_s']:,.0f} | {r16['p50_ms']:.3f} | {r16['p99_ms']:.3f} | 1.00 | |")
ok1 = single['ops_per_s'] / r1['ops_per_s']
print(f"| dedupgate HTTP single claim, {conns} conns | {single['ops_per_s']:,.0f} | {single['p50_ms']:.3f} | {single['p99_ms']:.3f} | {ok1:.2f}x of -P 1 | >= 0.5x, p99 < 5 ms |")
okb = batched['ops_per_s'] / r16['ops_per_s']
print(f"| dedupgate HTTP batch of {batch} claims, {conns} conns | {batched['ops_per_s']:,.0f} | {batched['p50_ms']:.3f} | {batched['p99_ms']:.3f} | {okb:.2f}x of -P 16 | >= 1x |")
for name, path, base, label in [("single claim", "mem-single", r1, "-P 1"), (f"batch of {batch} claims", "mem-batch", r16, "-P 16")]:
    m = json.load(open(f"{work}/{path}.json"))
    print(f"| memory store (HTTP face only): {name}, {conns} conns | {m['ops_per_s']:,.0f} | {m['p50_ms']:.3f} | {m['p99_ms']:.3f} | {m['ops_per_s']/base['ops_per_s']:.2f}x of {label} | not durable: for attribution |")
print()
print(f"single: {single['requests_ok']} requests ok, {single['requests_failed']} failed; "
      f"batch: {batched['requests_ok']} requests ok ({batched['requests_per_s']:,.0f} req/s), {batched['requests_failed']} failed")
PY
