"""/health, /ready and routing errors."""

import httpx

from tests.server.conftest import ServerProcess


def test_health_shows_the_plan(server: ServerProcess) -> None:
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    plan = body["plan"]
    assert (plan["profile"], plan["basis"], plan["device"], plan["dtype"]) == (
        "exact",
        "parity with upstream",
        "cpu",
        "fp32",
    )
    # The same plan in one start-up log line and as the info metric.
    server.log_with("plan: profile exact (parity with upstream): cpu=", "device=cpu", "hop_growth=on")
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "cosyserve_plan_info{" in metrics and 'profile="exact"' in metrics


def test_ready(server: ServerProcess) -> None:
    response = server.ready()
    assert response.status_code == 200
    assert response.json() == {
        "status": "ready",
        "model": "tiny",
        "engine_alive": True,
        "in_flight": 0,
        "engine_requests": 0,
        "capacity": 4,
        "models": {"tiny": "ready"},
    }


def test_unknown_route_and_method(server: ServerProcess) -> None:
    missing = httpx.get(f"{server.url}/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    wrong = httpx.get(f"{server.url}/v1/audio/speech")
    assert wrong.status_code == 405
    assert wrong.json()["error"]["code"] == "method_not_allowed"
