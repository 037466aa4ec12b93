"""schemathesis against the app's own /openapi.json: no 5xx, every response as declared.

Its own Redis and API and no worker, so generated jobs (some of them huge) are
only queued, never run. Fixed seed, bounded time.
"""

from __future__ import annotations

import re
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.stack import ROOT, Stack, private_stack

MIN_REQUESTS = 500
ARTIFACTS = ROOT / "test-artifacts"


@pytest.fixture(scope="module")
def api_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with private_stack(tmp_path_factory.mktemp("fuzz"), workers=0) as stack:
        yield stack

def test_schemathesis_finds_no_server_error_and_no_schema_mismatch(api_only: Stack) -> None:
    st = Path(ROOT / ".venv/bin/st")
    command = [
        str(st) if st.exists() else "st", "run", f"{api_only.base_url}/openapi.json",
        "--checks", "not_a_server_error,response_schema_conformance,status_code_conformance,"
                    "content_type_conformance",
        "--phases", "coverage", "--seed", "42", "--max-examples", "20", "--workers", "1",
        "--request-timeout", "5",
        # /readyz answers 503 by design here: this API has no worker.
        "--exclude-path", "/readyz",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=ROOT)
    if done.returncode != 0:
        # Seen once: schemathesis 4.32.5 crashed inside its own generator (a KeyError in its
        # cache) with every request passing. Keep the evidence, run it again, and fail only
        # if the second run fails too: a real API bug reproduces with the same seed.
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "schemathesis-first-failure.txt").write_text(done.stdout + done.stderr)
        warnings.warn("schemathesis failed once; see test-artifacts/schemathesis-first-failure.txt", stacklevel=1)
        done = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-6000:]
    generated = re.search(r"(\d+) generated", done.stdout)
    assert generated is not None, done.stdout[-2000:]
    assert int(generated.group(1)) >= MIN_REQUESTS
