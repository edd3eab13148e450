"""Property-based API check: schemathesis over the live app's OpenAPI on PostgreSQL, network-isolated.

tests/service/api_fuzz.py does the work inside `unshare -n` (a network namespace with only loopback; the
app reaches PostgreSQL through its Unix socket): every operation, examples + coverage + fuzzing phases with a
fixed seed and a bounded number of examples, every check but `positive_data_acceptance` and
`negative_data_rejection` (see there why).
Any 5xx, response-schema violation, undocumented status or content type, missing `Allow` on a 405 fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.service.api_fuzz import SOCKET_DIR

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def empty_database(postgres_admin_url: str) -> Iterator[str]:
    name = f"grpo_fuzz_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.mark.slow
def test_api_conforms_to_its_openapi(empty_database: str, tmp_path: Path) -> None:
    if not Path(SOCKET_DIR).is_dir():
        pytest.fail(f"PostgreSQL's Unix socket directory {SOCKET_DIR} is missing (GRPO_TEST_POSTGRES_SOCKET_DIR)")
    command = ["unshare", "-n", sys.executable, "-m", "tests.service.api_fuzz",
               "--database", empty_database, "--workdir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540, check=False)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-20000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"schemathesis: {result}")
    # The run really covered the API: every operation, every phase, thousands of cases, none erroring.
    assert result["operations"] == result["operations_total"] >= 30
    assert result["phases"] == {"examples": "success", "coverage": "success", "fuzzing": "success",
                                "stateful": "skip"}
    assert result["cases"] >= 1000
    assert result["cases_with_failures"] == 0 and result["errored"] == 0
