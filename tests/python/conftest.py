"""Fixtures shared by the Python tests: the dedupgate binary, free ports, and running gates.

The tests drive the real binary (built by `cargo test --workspace`, or named by DEDUPGATE_BIN)
with real clients; every server they start listens on a free loopback port and is stopped after.
"""

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _target_dir():
    out = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout
    return Path(json.loads(out)["target_directory"])


@pytest.fixture(scope="session")
def dedupgate_bin():
    """Path of the dedupgate binary under test."""
    path = Path(os.environ.get("DEDUPGATE_BIN") or _target_dir() / "debug" / "dedupgate")
    if not path.exists():
        pytest.fail(f"{path} does not exist: run `cargo build -p dedupgate` or set DEDUPGATE_BIN")
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port, proc, log, timeout=30.0):
    """Waits until something accepts on `port`; fails with the process's log if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"dedupgate exited with {proc.returncode}:\n{Path(log).read_text()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    proc.kill()
    pytest.fail(f"nothing listened on 127.0.0.1:{port} after {timeout} s:\n{Path(log).read_text()}")


class Running:
    """A dedupgate process listening on `url`; stopped by `stop()` (the fixtures call it)."""

    def __init__(self, args, port, log):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(args, stdout=self._out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        wait_listening(port, self.proc, log)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


@pytest.fixture
def start(dedupgate_bin, tmp_path):
    """start(subcommand, *args) runs `dedupgate SUBCOMMAND --listen 127.0.0.1:PORT ARGS…`."""
    started = []

    def run(subcommand, *args):
        port = free_port()
        log = tmp_path / f"{subcommand}-{port}.log"
        cmd = [str(dedupgate_bin), subcommand, "--listen", f"127.0.0.1:{port}", *map(str, args)]
        r = Running(cmd, port, log)
        started.append(r)
        return r

    yield run
    for r in started:
        r.stop()


@pytest.fixture
def gate(start):
    """`dedupgate serve` on the memory store; yields its base URL."""
    r = start("serve", "--store", "memory:")
    with urllib.request.urlopen(r.url + "/healthz", timeout=10) as resp:
        assert resp.status == 200
    return r.url
