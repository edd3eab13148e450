"""Property-based API check: schemathesis against the app's own OpenAPI, authenticated with a real key.

Bounded (a few examples per operation) so the suite stays fast; runs on SQLite and PostgreSQL.
Default checks: no 5xx, status codes, content types, headers and bodies conform to the documented schema.
Excluded: `positive_data_acceptance` — a schema-valid body may still be refused with a 422 for reasons a
schema cannot state (a dataset id that does not exist, a JSONL file whose lines are not prompts).
"""

from __future__ import annotations

from typing import Any

import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.service.factories import TenantHeaders

EXAMPLES_PER_OPERATION = 6


def test_api_conforms_to_its_openapi(app: FastAPI, tenant_a: TenantHeaders) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures: list[str] = []
    statuses: list[int] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20  # every router is in the schema
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            response = case.call_and_validate(
                headers=dict(tenant_a), excluded_checks=[positive_data_acceptance]
            )
            statuses.append(response.status_code)

        try:
            check()
        except Exception as exc:  # collect every failing operation, then fail once with all of them
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
    assert len(statuses) >= 2 * len(operations)  # the checks really ran requests
    assert any(200 <= status < 300 for status in statuses)
