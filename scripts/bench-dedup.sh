#!/usr/bin/env bash
# Benchmark of `dedupgate dedup` (issue 5): a generated JSON Lines file of N lines (default 10
# million; a key of two fields; 30% of the lines repeat an earlier key), deduplicated by
#   - dedupgate dedup (release build),
#   - awk '!seen[$k]++' (mawk and gawk, when installed),
#   - qsv dedup (from crates.io; it reads CSV, so it gets the same records as CSV, beside
#     dedupgate on that CSV),
# each timed with /usr/bin/time -v for wall time and peak memory, in one run; then, on the first
# LEDGER_LINES lines (default: all N), dedupgate without a ledger and with --ledger on the
# embedded store: a first run into a fresh directory, a re-run over the same file (every key
# known), and the same first run for each extra mode in LEDGER_MODES (default at-most-once).
# Prints markdown tables; compare the "records out" column across rows.
#
# usage: scripts/bench-dedup.sh [LINES [LEDGER_LINES]]
# env:   BENCH_DIR (default /tmp/dedupgate-bench), DEDUPGATE_BIN (default target/release/dedupgate),
#        QSV_BIN (default: qsv or qsvlite on PATH), LEDGER_MODES (default "at-most-once"; empty
#        for none), LEDGER_MEMORY=1 adds a --ledger memory: row, SKIP_OTHERS=1 skips awk/CSV/qsv
set -euo pipefail
cd "$(dirname "$0")/.."

LINES=${1:-10000000}
LEDGER_LINES=${2:-$LINES}
LEDGER_MODES=${LEDGER_MODES-at-most-once}
DIR=${BENCH_DIR:-/tmp/dedupgate-bench}
BIN=${DEDUPGATE_BIN:-target/release/dedupgate}
QSV=${QSV_BIN:-$(command -v qsv || command -v qsvlite || true)}
mkdir -p "$DIR"
DATA="$DIR/events-$LINES.jsonl"
CSV="$DIR/events-$LINES.csv"

if [ ! -x "$BIN" ]; then
  cargo build --release -p dedupgate
fi

# Key: (user, kind). Line i repeats a uniformly chosen earlier key with probability 0.3.
if [ ! -s "$DATA" ]; then
  echo "generating $DATA ($LINES lines)" >&2
  mawk -v n="$LINES" 'BEGIN {
    srand(20260301); split("view click cart buy share", K, " "); d = 0
    for (i = 0; i < n; i++) {
      if (d > 0 && rand() < 0.3) k = int(rand() * d); else k = d++
      printf "{\"user\":\"u%08d\",\"kind\":\"%s\",\"ts\":\"2026-03-01T%02d:%02d:%02dZ\",\"amount\":%.2f,\"session\":\"s%08x\"}\n",
        int(k / 5), K[k % 5 + 1], int(i / 360000) % 24, int(i / 6000) % 60, int(i / 100) % 60,
        rand() * 100, int(rand() * 2147483647)
    }
  }' > "$DATA"
fi
if [ ! -s "$CSV" ]; then
  echo "writing the same records as $CSV" >&2
  { echo "user,kind,ts,amount,session"
    mawk -F'"' '{ a = $15; gsub(/[:,]/, "", a); print $4 "," $8 "," $12 "," a "," $18 }' "$DATA"; } > "$CSV"
fi
BYTES=$(stat -c %s "$DATA")
echo "input: $LINES lines, $((BYTES / 1000000)) MB; $(nproc) cores; $(uname -r)" >&2

ROWS=()
# measure NAME OUTFILE CMD...: runs CMD with stdout to OUTFILE, records wall time and peak RSS.
measure() {
  local name=$1 out=$2; shift 2
  sync
  cat "$DATA" "$CSV" > /dev/null # page cache warm for everyone alike
  /usr/bin/time -v -o "$DIR/time.txt" "$@" > "$out" 2> "$DIR/stderr.txt" || {
    echo "$name failed:" >&2; cat "$DIR/stderr.txt" >&2; return 1; }
  local wall rss records cpu
  cpu=$(awk -F': ' '/User time|System time/ { s += $2 } END { printf "%.1f", s }' "$DIR/time.txt")
  wall=$(awk -F': ' '/Elapsed \(wall clock\)/ { n = split($2, t, ":"); s = 0; for (i = 1; i <= n; i++) s = s * 60 + t[i]; print s }' "$DIR/time.txt")
  rss=$(awk -F': ' '/Maximum resident set size/ { printf "%.0f", $2 / 1024 }' "$DIR/time.txt")
  records=$(wc -l < "$out")
  ROWS+=("$name|$wall|$rss|$records|$cpu")
  printf '%-56s %8ss %8s MB %10s lines %8s cpu-s\n' "$name" "$wall" "$rss" "$records" "$cpu" >&2
}

measure "dedupgate dedup (JSONL)" "$DIR/out-dg.jsonl" \
  "$BIN" dedup --quiet --key-fields user,kind "$DATA"
if [ -z "${SKIP_OTHERS:-}" ]; then
  for awk in mawk gawk; do
    if command -v $awk > /dev/null; then
      measure "$awk -F'\"' '!seen[\$4,\$8]++' (JSONL)" "$DIR/out-$awk.jsonl" $awk -F'"' '!seen[$4,$8]++' "$DATA"
    fi
  done
  measure "dedupgate dedup (CSV)" "$DIR/out-dg.csv" "$BIN" dedup --quiet --key-fields user,kind "$CSV"
  if [ -n "$QSV" ]; then
    measure "qsv dedup -s user,kind (CSV) [$(basename "$QSV")]" "$DIR/out-qsv.csv" "$QSV" dedup -s user,kind "$CSV"
  else
    echo "qsv not available: skipped (see docs/benchmarks-cli.md)" >&2
  fi
fi
# table [BASE_WALL]: the rows so far; with BASE_WALL, a column of wall time over it.
table() {
  local base=${1:-}
  echo
  if [ -n "$base" ]; then
    echo "| run | wall s | CPU s | peak RSS MB | records out | vs. no ledger |"
    echo "|---|---:|---:|---:|---:|---:|"
  else
    echo "| tool | wall s | CPU s | peak RSS MB | records out |"
    echo "|---|---:|---:|---:|---:|"
  fi
  for r in "${ROWS[@]}"; do
    IFS='|' read -r name wall rss records cpu <<< "$r"
    if [ -n "$base" ]; then
      echo "| \`$name\` | $wall | $cpu | $rss | $records | $(awk -v a="$wall" -v b="$base" 'BEGIN { printf "%.1fx", a / b }') |"
    else
      echo "| \`$name\` | $wall | $cpu | $rss | $records |"
    fi
  done
}
echo "## $LINES lines"
table
ROWS=()

SMALL=$DATA
if [ "$LEDGER_LINES" != "$LINES" ]; then
  SMALL="$DIR/events-$LEDGER_LINES.jsonl"
  head -n "$LEDGER_LINES" "$DATA" > "$SMALL"
fi
LEDGER_ARGS=(dedup --quiet --key-fields user,kind --ttl 1d)
measure "dedupgate dedup, no ledger" "$DIR/out-s.jsonl" \
  "$BIN" dedup --quiet --key-fields user,kind "$SMALL"
BASE=$(IFS='|' read -r _ wall _ <<< "${ROWS[0]}"; echo "$wall")
if [ -n "${LEDGER_MEMORY:-}" ]; then
  measure "dedupgate dedup --ledger memory:" "$DIR/out-s-mem.jsonl" \
    "$BIN" "${LEDGER_ARGS[@]}" --ledger memory: "$SMALL"
fi
rm -rf "$DIR/ledger"
measure "dedupgate dedup --ledger embedded (first run)" "$DIR/out-s-emb.jsonl" \
  "$BIN" "${LEDGER_ARGS[@]}" --ledger "embedded:$DIR/ledger" "$SMALL"
measure "dedupgate dedup --ledger embedded (re-run: all known)" "$DIR/out-s-emb2.jsonl" \
  "$BIN" "${LEDGER_ARGS[@]}" --ledger "embedded:$DIR/ledger" "$SMALL"
if ! cmp -s "$DIR/out-s.jsonl" "$DIR/out-s-emb.jsonl"; then
  echo "the ledger run's output differs from the run without a ledger" >&2
  exit 1
fi
du -sh "$DIR/ledger" >&2
for mode in $LEDGER_MODES; do
  rm -rf "$DIR/ledger"
  measure "dedupgate dedup --ledger embedded --ledger-mode $mode (first run)" "$DIR/out-s-$mode.jsonl" \
    "$BIN" "${LEDGER_ARGS[@]}" --ledger-mode "$mode" --ledger "embedded:$DIR/ledger" "$SMALL"
done
rm -rf "$DIR/ledger"
echo
echo "## first $LEDGER_LINES lines, ledger"
table "$BASE"
