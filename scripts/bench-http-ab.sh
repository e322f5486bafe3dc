#!/usr/bin/env bash
# Two builds of the gate, one HTTP single-claim load, in one run: did a change make the server
# slower? Each round starts `BEFORE serve` and `AFTER serve` in turn (alternating which goes
# first, so a neighbour's noise hits both alike), each on a fresh embedded store directory
# (every answer fdatasync'd before it is sent), and drives it with wrk single claims
# (scripts/wrk-claim.lua: every key new, every answer must be 200 "new"; a run with any other
# answer fails the script). Prints one row per round and the median of after/before.
# Usage: scripts/bench-http-ab.sh BEFORE_BIN AFTER_BIN [ROUNDS] [SECONDS] [CONNS]
# Build a before binary with, for example:
#   git worktree add /tmp/before COMMIT && (cd /tmp/before && cargo build --release -p dedupgate)
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${1:?usage: scripts/bench-http-ab.sh BEFORE_BIN AFTER_BIN [ROUNDS] [SECONDS] [CONNS]}
AFTER=${2:?usage: scripts/bench-http-ab.sh BEFORE_BIN AFTER_BIN [ROUNDS] [SECONDS] [CONNS]}
ROUNDS=${3:-10}
SECS=${4:-8}
CONNS=${5:-50}
command -v wrk >/dev/null || { echo "wrk is missing: apt-get install -y wrk" >&2; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/dedupgate-bench-ab.XXXXXX")
SERVER=
cleanup() {
  if [ -n "$SERVER" ]; then kill -TERM "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

one_run() { # $1 binary, $2 name; prints "req/s p99_ms"
  local port url
  port=$(free_port); url="http://127.0.0.1:$port"
  "$1" serve --listen "127.0.0.1:$port" --store "$WORK/store-$2" --in-flight-max 4096 2>"$WORK/$2.log" &
  SERVER=$!
  for _ in $(seq 1 100); do curl -sf "$url/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
  curl -sf "$url/healthz" >/dev/null || { cat "$WORK/$2.log" >&2; exit 1; }
  wrk -t 2 -c "$CONNS" -d "${SECS}s" --timeout 10s --latency -s scripts/wrk-claim.lua "$url" -- "$2" \
    >"$WORK/$2.out"
  kill -TERM "$SERVER"; wait "$SERVER" || true; SERVER=
  python3 - "$WORK/$2.out" <<'PY'
import json, sys
line = next(l for l in open(sys.argv[1]) if l.startswith("WRK_RESULT "))
r = json.loads(line[len("WRK_RESULT "):])
bad = r["non2xx"] + r["bad_items"] + r["socket_errors"]
if bad:
    sys.exit(f"INVALID run {sys.argv[1]}: {bad} answers were not 200 new")
print("%.0f %.2f" % (r["requests"] / (r["duration_us"] / 1e6), r["p99_us"] / 1000))
PY
}

echo "| round | before req/s (p99 ms) | after req/s (p99 ms) | after/before |"
echo "|---|---|---|---|"
ratios=()
for r in $(seq 1 "$ROUNDS"); do
  if (( r % 2 )); then
    out=$(one_run "$BEFORE" "before-$r"); read -r b bp <<<"$out"; out=$(one_run "$AFTER" "after-$r"); read -r a ap <<<"$out"
  else
    out=$(one_run "$AFTER" "after-$r"); read -r a ap <<<"$out"; out=$(one_run "$BEFORE" "before-$r"); read -r b bp <<<"$out"
  fi
  ratio=$(python3 -c "print('%.3f' % ($a / $b))")
  ratios+=("$ratio")
  echo "| $r | $b ($bp) | $a ($ap) | $ratio |"
done
python3 -c "import statistics,sys; print('median after/before: %.3f' % statistics.median(float(x) for x in sys.argv[1:]))" "${ratios[@]}"
echo "(wrk -t2 -c$CONNS -d${SECS}s single claims, embedded store, $(nproc) cores; before: $("$BEFORE" --version 2>/dev/null || echo "$BEFORE"), after: $("$AFTER" --version 2>/dev/null || echo "$AFTER"))"
