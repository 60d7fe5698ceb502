"""Admission control and disconnects under load.

Overload: with capacity C (max_active + max_queued), 4*C concurrent clients -> exactly C
are served in full and every other one gets 429 with Retry-After at once. Disconnects:
50 clients that leave mid-stream (or before their first byte) leave no request behind.
"""

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess, running_server

VOICE = "英文男"
# The target is 100 ms (measured figures are in the issue report); the assertion allows
# for a shared, overloaded 2-core test machine while still failing if refused requests
# waited behind synthesis (every served request takes longer than this).
REFUSAL_BUDGET_S = 1.0


@dataclass(frozen=True)
class Outcome:
    status: int
    seconds_to_status: float
    seconds_to_end: float
    body_bytes: int
    retry_after: str | None


async def speak(client: httpx.AsyncClient, tokens: int) -> Outcome:
    body = {"model": "tts-1", "input": "Hello.", "voice": VOICE, "response_format": "pcm", "stream": True}
    body |= {"min_tokens": tokens, "max_tokens": tokens}
    start = time.perf_counter()
    async with client.stream("POST", "/v1/audio/speech", json=body) as response:
        seconds = time.perf_counter() - start
        data = await response.aread()
    end = time.perf_counter() - start
    return Outcome(response.status_code, seconds, end, len(data), response.headers.get("retry-after"))


def test_overload_is_refused_at_once(server: ServerProcess) -> None:
    capacity = server.ready().json()["capacity"]
    tokens = 100

    async def run() -> list[Outcome]:
        limits = httpx.Limits(max_connections=8 * capacity)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            # Open the connections first: the budget is for the server's answer, not TCP setup.
            await asyncio.gather(*(client.get("/health") for _ in range(4 * capacity)))
            return await asyncio.gather(*(speak(client, tokens) for _ in range(4 * capacity)))

    outcomes = asyncio.run(run())
    served = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    assert (len(served), len(refused)) == (capacity, 3 * capacity), [o.status for o in outcomes]
    assert all(o.body_bytes == tokens * 960 * 2 for o in served)  # complete, none timed out
    assert all(o.retry_after == "1" for o in refused)
    slowest = max(o.seconds_to_status for o in refused)
    waits = sorted(o.seconds_to_status for o in refused)
    print(
        f"\ncapacity {capacity}, {4 * capacity} clients: {len(refused)} refused; 429 after "
        f"median {waits[len(waits) // 2] * 1000:.0f} ms, slowest {slowest * 1000:.0f} ms; served requests "
        f"took {min(o.seconds_to_end for o in served):.2f}-{max(o.seconds_to_end for o in served):.2f} s"
    )
    assert slowest < REFUSAL_BUDGET_S
    assert slowest < min(o.seconds_to_end for o in served)


@pytest.fixture(scope="module")
def roomy_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    with running_server(
        tiny_model_dir, tmp_path_factory.mktemp("roomy"), max_active=4, max_queued=46
    ) as process:
        yield process


def test_fifty_disconnects_leave_nothing_behind(roomy_server: ServerProcess) -> None:
    server = roomy_server
    rng = random.Random(0)

    async def leave_early(client: httpx.AsyncClient, after_first_bytes: bool, delay: float) -> str:
        body = {"model": "tts-1", "input": "Hello.", "voice": VOICE, "response_format": "pcm"}
        body |= {"stream": True, "min_tokens": 2000, "max_tokens": 2000}
        try:
            async with asyncio.timeout(None if after_first_bytes else delay):
                async with client.stream("POST", "/v1/audio/speech", json=body) as response:
                    assert response.status_code == 200
                    async for _ in response.aiter_bytes():
                        return "after first bytes"
        except TimeoutError:
            return "before first byte"
        return "no audio"

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(
                *(leave_early(client, i % 2 == 0, rng.uniform(0.05, 1.0)) for i in range(50))
            )

    results = asyncio.run(run())
    # Odd clients give up after a random delay; one may have had its first bytes by then.
    assert results.count("after first bytes") >= 25
    assert "no audio" not in results
    start = time.monotonic()  # every client has gone
    while True:
        state = server.ready().json()
        if (state["in_flight"], state["engine_requests"]) == (0, 0):
            break
        assert time.monotonic() - start < 10, state
        time.sleep(0.05)
    idle_after = time.monotonic() - start
    left_early = results.count("before first byte")
    print(
        f"\n50 disconnects ({left_early} before their first byte): "
        f"idle {idle_after:.2f} s after the last one left"
    )
    # The server still works.
    body = {"model": "x", "input": "Hi.", "voice": VOICE, "response_format": "pcm"}
    body |= {"min_tokens": 5, "max_tokens": 5}
    response = httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=60)
    assert response.status_code == 200 and len(response.content) == 5 * 960 * 2
