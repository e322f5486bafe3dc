#!/usr/bin/env bash
# Benchmark of `dedupgate proxy` with wrk, in one run, over one or more stores and two upstreams:
#   echo:     the sample API's in-memory echo (no work per request: shows the proxy's pure cost);
#   postgres: the sample API with --postgres: every POST commits one INSERT into PostgreSQL and
#             answers the new row's id, like a payments API creating a charge (real durable work).
# For each upstream:
#   1. direct: POST straight to the sample API (the upstream);
#   2. first:  POST through the proxy, every request with a new Idempotency-Key (claim, forward,
#              store the response, answer);
#   3. replay: POST through the proxy, every request with the same key (answered from the store).
# One proxy per (upstream, store) runs beside the others; each scenario runs with few connections (latency:
# what the proxy adds to p50) and with many (throughput), in interleaved rounds, so every store
# is compared with the same direct figures of its upstream. Prints a Markdown table and the ratios (also written
# to $OUT, default target/bench-proxy.md).
#
# Usage: scripts/bench-proxy.sh [STORE...]   (default: memory: embedded:; embedded: alone means
#                                             a temporary directory; e.g. redis://127.0.0.1:6379)
# Env: DURATION (default 5s), ROUNDS (3), LAT_CONNS (4), TPUT_CONNS (64), THREADS (2), SKIP_BUILD=1,
#      UPSTREAMS ("echo postgres"), PG_URL (postgres://postgres@127.0.0.1:5432/test), PG_POOL (8:
#      the postgres upstream's connections; its table is created for the run and dropped after).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$#" -eq 0 ]; then set -- memory: embedded:; fi
STORES=("$@")
DURATION="${DURATION:-5s}"
ROUNDS="${ROUNDS:-3}"
LAT_CONNS="${LAT_CONNS:-4}"
TPUT_CONNS="${TPUT_CONNS:-64}"
THREADS="${THREADS:-2}"
OUT="${OUT:-target/bench-proxy.md}"
UP_PORT="${UP_PORT:-38080}" # the first upstream; its proxies listen on the next ports, the next
                            # upstream 20 ports further
read -r -a UPSTREAMS <<<"${UPSTREAMS:-echo postgres}"
PG_URL="${PG_URL:-postgres://postgres@127.0.0.1:5432/test}"
PG_POOL="${PG_POOL:-8}"
PG_TABLE="bench_proxy_charges_$$"

command -v wrk >/dev/null || { echo "wrk is missing: apt-get install -y wrk" >&2; exit 1; }

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  cargo build --release -q -p dedupgate --bin dedupgate
  cargo build --release -q -p dedupgate-proxy --features sample --example sample_api
fi
BIN=target/release/dedupgate
API=target/release/examples/sample_api

WORK="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [[ " ${UPSTREAMS[*]} " == *" postgres "* ]] && command -v psql >/dev/null; then
    psql -q "$PG_URL" -c "DROP TABLE IF EXISTS $PG_TABLE" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

wait_port() {
  for _ in $(seq 1 200); do
    (echo > "/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing listens on port $1" >&2; exit 1
}

up_port() { echo $((UP_PORT + 20 * $1)); }
px_port() { echo $((UP_PORT + 20 * $1 + 1 + $2)); }
for u in "${!UPSTREAMS[@]}"; do
  case "${UPSTREAMS[$u]}" in
    echo) "$API" "127.0.0.1:$(up_port "$u")" 2>"$WORK/api-$u.log" & ;;
    postgres) "$API" "127.0.0.1:$(up_port "$u")" --postgres "$PG_URL" --pool "$PG_POOL" \
      --table "$PG_TABLE" 2>"$WORK/api-$u.log" & ;;
    *) echo "unknown upstream ${UPSTREAMS[$u]} (echo, postgres)" >&2; exit 1 ;;
  esac
  PIDS+=($!)
  wait_port "$(up_port "$u")"
  for i in "${!STORES[@]}"; do
    spec="${STORES[$i]}"
    case "$spec" in
      embedded:) spec="embedded:$WORK/data-$u-$i" ;;
    esac
    RUST_LOG=warn "$BIN" proxy --upstream "http://127.0.0.1:$(up_port "$u")" \
      --listen "127.0.0.1:$(px_port "$u" "$i")" --store "$spec" --namespace "bench-$$-$RANDOM" \
      2>"$WORK/proxy-$u-$i.log" &
    PIDS+=($!)
    wait_port "$(px_port "$u" "$i")"
  done
done

BODY='{"amount":1000,"currency":"eur","customer":"cus_42","description":"benchmark order"}'
cat >"$WORK/post.lua" <<EOF
wrk.method = "POST"
wrk.body = '$BODY'
wrk.headers["Content-Type"] = "application/json"
EOF
cat >"$WORK/unique.lua" <<EOF
-- Every request gets a key no other request (thread, run) uses.
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
local n = 0
local prefix = "k"
function init(args)
  prefix = args[1] or "k"
end
function request()
  n = n + 1
  return wrk.format("POST", nil, {
    ["Content-Type"] = "application/json",
    ["Idempotency-Key"] = prefix .. "-" .. tid .. "-" .. n,
  }, '$BODY')
end
EOF

# run NAME CONNS URL ARGS... -> "p50_ms p99_ms rps errors"
run() {
  local conns="$1"; shift
  local out
  out="$(wrk -t"$THREADS" -c"$conns" -d"$DURATION" --latency "$@")"
  echo "$out" >>"$WORK/wrk.log"
  local p50 p99 rps non2xx errs
  p50="$(echo "$out" | awk '$1=="50%"{print $2}')"
  p99="$(echo "$out" | awk '$1=="99%"{print $2}')"
  rps="$(echo "$out" | awk '/^Requests\/sec/{printf "%.0f", $2}')"
  non2xx="$(echo "$out" | awk '/Non-2xx/{print $NF}')"
  errs="$(echo "$out" | awk '/Socket errors/{print $0}')"
  [ -n "$errs" ] && echo "wrk: $errs" >&2
  echo "$(to_ms "$p50") $(to_ms "$p99") $rps ${non2xx:-0}"
}

# wrk prints 512.00us / 1.20ms / 2.00s
to_ms() {
  awk -v v="$1" 'BEGIN{
    if (v ~ /us$/) { sub(/us$/,"",v); printf "%.3f", v/1000 }
    else if (v ~ /ms$/) { sub(/ms$/,"",v); printf "%.3f", v }
    else if (v ~ /s$/) { sub(/s$/,"",v); printf "%.3f", v*1000 }
    else print v }'
}

up() { echo "http://127.0.0.1:$(up_port "$1")/v1/charges"; }
px() { echo "http://127.0.0.1:$(px_port "$1" "$2")/v1/charges"; }
# Store the replayed response once per proxy.
for u in "${!UPSTREAMS[@]}"; do
  for i in "${!STORES[@]}"; do
    code="$(curl -s -o /dev/null -w '%{http_code}' -X POST "$(px "$u" "$i")" \
      -H 'Content-Type: application/json' -H 'Idempotency-Key: bench-replay' --data "$BODY")"
    [ "$code" = 201 ] || { echo "${UPSTREAMS[$u]} via ${STORES[$i]}: HTTP $code" >&2; exit 1; }
  done
done

# A durable first request waits for two commits, each one fdatasync of the store's journal: the
# disk's sync latency (where the embedded store's data lives) bounds that figure, and on a shared
# machine it moves with other people's I/O, so it is measured before and after the rounds.
fsync_probe() {
  command -v python3 >/dev/null || { echo "?"; return; }
  python3 - "$WORK/fsync-probe" <<'PY'
import os, sys, time
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)
ts = []
for i in range(200):
    os.pwrite(fd, b"x" * 512, (i % 8) * 4096)
    t = time.perf_counter()
    os.fdatasync(fd)
    ts.append(time.perf_counter() - t)
ts.sort()
print("%.3f" % (ts[len(ts) // 2] * 1000))
PY
}
SYNC_BEFORE="$(fsync_probe)"

# Interleaved rounds, so background load on a shared machine hits every scenario alike; the
# table shows each figure's median over the rounds.
median() { sort -n | awk '{v[NR]=$1} END{ if (NR==0) print "-"; else print v[int((NR+1)/2)] }'; }
for conns in "$LAT_CONNS" "$TPUT_CONNS"; do
  for round in $(seq 1 "$ROUNDS"); do
    for u in "${!UPSTREAMS[@]}"; do
      run "$conns" -s "$WORK/post.lua" "$(up "$u")" >>"$WORK/direct-$u-$conns"
      for i in "${!STORES[@]}"; do
        run "$conns" -s "$WORK/unique.lua" "$(px "$u" "$i")" -- "c$conns-r$round-$$-$RANDOM" \
          >>"$WORK/first-$u-$i-$conns"
        run "$conns" -s "$WORK/post.lua" -H 'Idempotency-Key: bench-replay' "$(px "$u" "$i")" \
          >>"$WORK/replay-$u-$i-$conns"
      done
    done
  done
done

SYNC_AFTER="$(fsync_probe)"
col() { awk -v c="$1" '{print $c}' "$2" | median; }
{
  rev="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  dirty="$(git status --porcelain -- crates scripts 2>/dev/null | grep -c . || true)"
  echo "upstreams: ${UPSTREAMS[*]}$([[ " ${UPSTREAMS[*]} " == *" postgres "* ]] && echo " (pool $PG_POOL)"); stores: $(printf '`%s` ' "${STORES[@]}"); wrk -t$THREADS -d$DURATION, median of $ROUNDS interleaved rounds; $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg); commit $rev$([ "${dirty:-0}" != 0 ] && echo " (+ uncommitted changes)"); $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "fdatasync p50 of a 512-byte write on this disk: $SYNC_BEFORE ms before the rounds, $SYNC_AFTER ms after."
  echo
  echo "| upstream | connections | scenario | store | p50 ms | p99 ms | requests/s | non-2xx (all rounds) |"
  echo "|---|---:|---|---|---:|---:|---:|---:|"
  row() { # upstream conns name store file
    echo "| $1 | $2 | $3 | $4 | $(col 1 "$5") | $(col 2 "$5") | $(col 3 "$5") | $(awk '{s+=$4} END{print s+0}' "$5") |"
  }
  for u in "${!UPSTREAMS[@]}"; do
    for conns in "$LAT_CONNS" "$TPUT_CONNS"; do
      row "${UPSTREAMS[$u]}" "$conns" "direct to upstream" "-" "$WORK/direct-$u-$conns"
      for i in "${!STORES[@]}"; do
        row "${UPSTREAMS[$u]}" "$conns" "proxy, first requests" "\`${STORES[$i]}\`" "$WORK/first-$u-$i-$conns"
        row "${UPSTREAMS[$u]}" "$conns" "proxy, replays" "\`${STORES[$i]}\`" "$WORK/replay-$u-$i-$conns"
      done
    done
  done
  echo
  for u in "${!UPSTREAMS[@]}"; do
    d50="$(col 1 "$WORK/direct-$u-$LAT_CONNS")"
    drps="$(col 3 "$WORK/direct-$u-$TPUT_CONNS")"
    for i in "${!STORES[@]}"; do
      f50="$(col 1 "$WORK/first-$u-$i-$LAT_CONNS")"
      r50="$(col 1 "$WORK/replay-$u-$i-$LAT_CONNS")"
      rrps="$(col 3 "$WORK/replay-$u-$i-$TPUT_CONNS")"
      awk -v up="${UPSTREAMS[$u]}" -v s="${STORES[$i]}" -v c="$LAT_CONNS" -v t="$TPUT_CONNS" \
          -v d="$d50" -v f="$f50" -v r="$r50" -v drps="$drps" -v rrps="$rrps" 'BEGIN{
        printf "- %s upstream, `%s`: first requests add %.3f ms to p50 at %d connections (target < 1 ms: %s); ", up, s, f-d, c, (f-d < 1 ? "met" : "missed")
        printf "replays p50 %.2fx the direct p50 at %d connections (target <= 1: %s), ", r/d, c, (r <= d ? "met" : "missed")
        printf "%.2fx the direct requests/s at %d connections (target >= 1: %s)\n", rrps/drps, t, (rrps >= drps ? "met" : "missed") }'
    done
  done
} | tee "$OUT"
for u in "${!UPSTREAMS[@]}"; do
  for i in "${!STORES[@]}"; do
    if [ -s "$WORK/proxy-$u-$i.log" ]; then
      echo; echo "proxy log of ${UPSTREAMS[$u]} via ${STORES[$i]} (last lines):"
      tail -n 5 "$WORK/proxy-$u-$i.log"
    fi
  done
  if grep -qv '^sample API' "$WORK/api-$u.log" 2>/dev/null; then
    echo; echo "${UPSTREAMS[$u]} upstream log (last lines):"; tail -n 5 "$WORK/api-$u.log"
  fi
done
