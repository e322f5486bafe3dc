#!/usr/bin/env bash
# The test command (README's second command): installs the system packages the tests use when
# they are missing (Debian/Ubuntu apt, as root or through sudo), then runs every test of the
# workspace. Arguments go to `cargo test`.
#
#   scripts/test.sh [CARGO TEST ARGS…]     install what is missing, then cargo test --workspace
#   scripts/test.sh --install-only         only install what is missing
#
# The tests use: redis-server and PostgreSQL's binaries (servers the tests own), fiu-utils and
# a C compiler (the torture harness's storage faults), faketime (its clock jumps). They talk to
# the local Redis (127.0.0.1:6379) and PostgreSQL (127.0.0.1:5432, user postgres, db test).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null || missing+=(redis-server redis-tools)
ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || missing+=(postgresql)
command -v fiu-ctrl >/dev/null || missing+=(fiu-utils)
ls /usr/lib/*/faketime/libfaketimeMT.so.1 >/dev/null 2>&1 || missing+=(faketime)
command -v cc >/dev/null || missing+=(gcc)
if [ ${#missing[@]} -gt 0 ]; then
  echo "scripts/test.sh: installing what the tests need: ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi
exec cargo test --workspace "$@"
