"""The app's access control in-process (no model load: the lifespan is not run): request
rate limits with Retry-After, open paths, and the warning when auth is off on a
non-loopback address."""

import logging

import pytest
from fastapi.testclient import TestClient

from cosyserve.server.auth.keys import hash_secret
from cosyserve.server.http.app import create_app
from cosyserve.server.settings import Settings, SettingsError

KEY = "csk_app_test"


def _settings(**overrides: object) -> Settings:
    return Settings.load(auth_api_keys=f"svc:{hash_secret(KEY, log2_n=10)}", grpc_port=0, **overrides)


def test_requests_per_minute_then_429_with_retry_after() -> None:
    client = TestClient(create_app(_settings(rate_limit_rpm=2)))
    headers = {"Authorization": f"Bearer {KEY}"}
    assert [client.get("/v1/models", headers=headers).status_code for _ in range(2)] == [200, 200]
    refused = client.get("/v1/models", headers=headers)
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "30"
    assert refused.json()["error"]["code"] == "rate_limited"
    assert client.get("/health").status_code == 200  # probes are neither authenticated nor limited
    assert client.get("/v1/models").status_code == 401  # no credential: refused before the limiter


def test_metrics_open_when_configured() -> None:
    closed = TestClient(create_app(_settings()))
    opened = TestClient(create_app(_settings(auth_metrics=False)))
    assert closed.get("/metrics").status_code == 401
    assert opened.get("/metrics").status_code != 401


def test_auth_needs_a_method_or_an_explicit_off(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(SettingsError, match='auth_mode = "none"'):
        create_app(Settings.load(grpc_port=0))
    with caplog.at_level(logging.WARNING):
        create_app(Settings.load(auth_mode="none", host="127.0.0.1", grpc_port=0))
        assert "authentication is off" not in caplog.text
        client = TestClient(create_app(Settings.load(auth_mode="none", host="0.0.0.0", grpc_port=0)))
    assert "authentication is off" in caplog.text
    assert client.get("/v1/models").status_code == 200
