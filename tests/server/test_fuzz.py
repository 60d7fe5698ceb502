"""Schemathesis against the served OpenAPI schema: no request, however malformed, gets a 5xx.

Forced token counts are clamped so that random bodies stay cheap on the tiny model (the
extension fields are still exercised, with small values). The default run sends a few
examples per operation; ``-m slow`` sends many more.
"""

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.schemas import OpenApiSchema

from tests.server.conftest import ServerProcess

MAX_FUZZ_TOKENS = 5


@pytest.fixture(scope="module")
def api_schema(server: ServerProcess) -> OpenApiSchema:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def _call_without_5xx(case: schemathesis.Case[Any], url: str) -> None:
    if isinstance(case.body, dict):
        for name in ("min_tokens", "max_tokens", "first_hop"):
            value = case.body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_FUZZ_TOKENS:
                case.body[name] = MAX_FUZZ_TOKENS
        case.body.setdefault("max_tokens", MAX_FUZZ_TOKENS)
    response = case.call(base_url=url, timeout=120)
    assert response.status_code < 500, (
        case.method,
        case.path,
        case.body,
        response.status_code,
        response.text,
    )


_SETTINGS: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": list(HealthCheck),
    "database": None,
}


@schema.parametrize()
@settings(max_examples=3, **_SETTINGS)
def test_no_server_errors(case: schemathesis.Case[Any], server: ServerProcess) -> None:
    _call_without_5xx(case, server.url)


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=40, **_SETTINGS)
def test_no_server_errors_many(case: schemathesis.Case[Any], server: ServerProcess) -> None:
    _call_without_5xx(case, server.url)
