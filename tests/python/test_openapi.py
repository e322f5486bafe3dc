"""docs/openapi.json against the real server: schemathesis generates requests from the document
(valid and invalid ones, every operation) and checks every answer against it, with all of its
checks. Bounded: a fixed number of examples per operation, and a time limit well under five
minutes. The seed is random and printed; replay a failure with DEDUPGATE_TEST_SEED=SEED.
"""

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

DOC = ROOT / "docs" / "openapi.json"
CONFIG = Path(__file__).with_name("schemathesis.toml")
TOKEN = "openapi-test-admin-token"
MAX_EXAMPLES = 50
TIME_LIMIT_S = 240


def schemathesis_cli():
    beside = Path(sys.executable).with_name("st")
    return str(beside) if beside.exists() else shutil.which("st")


def test_the_server_answers_as_its_openapi_document_says(start, tmp_path):
    # With a token configured, so the auth checks (ignored_auth) have something to check.
    config = tmp_path / "serve.toml"
    config.write_text(
        'store = "memory:"\n'
        f'[[tokens]]\nname = "schemathesis"\ntoken = "{TOKEN}"\n'
        'namespaces = ["*"]\nrole = "admin"\n'
    )
    gate = start("serve", "--config", config)
    seed = int(os.environ.get("DEDUPGATE_TEST_SEED") or random.randrange(2**32))
    print(f"schemathesis seed {seed} (replay with DEDUPGATE_TEST_SEED={seed})")
    cli = schemathesis_cli()
    assert cli, "schemathesis is not installed: pip install -r tests/python/requirements.txt"
    args = [
        cli, "--no-color", "--config-file", str(CONFIG), "run", str(DOC),
        "--url", gate.url,
        "--checks", "all",
        "--max-examples", str(MAX_EXAMPLES),
        "--seed", str(seed),
        "--generation-database", "none",
        "--request-timeout", "10",
        # The caller's token is a fixed, valid header: generated ones hold bytes no HTTP
        # server reads as a header (the server's HTTP parser answers them with a bare 400).
        "--generation-with-security-parameters", "false",
        "--header", f"Authorization: Bearer {TOKEN}",
    ]
    run = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True,
                         timeout=TIME_LIMIT_S)
    output = run.stdout + run.stderr
    assert run.returncode == 0, f"schemathesis (seed {seed}) found problems:\n{output}"
    assert "Tested: 10" in output, output
