#!/usr/bin/env bash
# The test command (README's second command): installs the system packages the tests use when
# they are missing (Debian/Ubuntu apt, as root or through sudo), then runs every test of the
# workspace, then the Python tests in tests/python (real Python clients against the binary cargo
# built), in a virtual environment under the target directory. Arguments go to `cargo test`.
#
#   scripts/test.sh [CARGO TEST ARGS…]     install what is missing, cargo test --workspace, pytest
#   scripts/test.sh --install-only         only install what is missing
#   DEDUPGATE_SKIP_PYTHON=1 scripts/test.sh   the Rust tests alone
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
command -v python3 >/dev/null || missing+=(python3)
python3 -m venv --help >/dev/null 2>&1 || missing+=(python3-venv)
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
cargo test --workspace "$@"

[ "${DEDUPGATE_SKIP_PYTHON:-}" = 1 ] && exit 0
target=$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
venv="$target/python-venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r tests/python/requirements.txt
cargo build -q -p dedupgate
exec "$venv/bin/python" -m pytest -q tests/python
