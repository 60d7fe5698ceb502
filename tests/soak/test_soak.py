"""Soak: 2,000 mixed requests against the real server (tiny model, forced short token
counts) -> no errors and RSS growth under 50 MB after warm-up.

Run: ``.venv/bin/python -m pytest -m slow tests/soak -s`` (prints the figures recorded in
docs/operations.md).
"""

import asyncio
import random
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from cosyserve.bench.server_load import LoadOptions, RequestResult, one_request
from tests.server.conftest import ServerProcess, running_server
from tests.server.http_audio import PROMPT_TEXT, prompt_wav

REQUESTS = 2000
WARM_UP = 200
CONCURRENCY = 8
ABORT_SHARE = 0.1
MAX_GROWTH_MB = 50.0
VOICES = ("中文女", "英文男", "soakvoice")  # two built-in speakers and one registered voice
# Streaming PCM, a streamed WAV, whole WAV and MP3 files.
SHAPES = ((True, "pcm"), (True, "wav"), (False, "wav"), (False, "mp3"))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.slow
def test_soak(tiny_model_dir: Path, tmp_path: Path) -> None:
    with running_server(tiny_model_dir, tmp_path, max_active=4, max_queued=12) as server:
        _soak(server)


def _soak(server: ServerProcess) -> None:
    files = {"audio": ("prompt.wav", prompt_wav(seconds=1.5), "audio/wav")}
    added = httpx.post(
        f"{server.url}/v1/audio/voices",
        data={"name": "soakvoice", "transcript": PROMPT_TEXT},
        files=files,
        timeout=120,
    )
    assert added.status_code == 201, added.text
    rng = random.Random(0)
    base = LoadOptions(url=server.url, voice=VOICES[0], timeout_s=120)
    plan: list[tuple[LoadOptions, bool]] = []
    for _ in range(REQUESTS):
        stream, fmt = rng.choice(SHAPES)
        options = replace(
            base, voice=rng.choice(VOICES), stream=stream, format=fmt, tokens=rng.randint(3, 12)
        )
        plan.append((options, stream and rng.random() < ABORT_SHARE))
    pid = server.process.pid
    marks: dict[str, float] = {"start": rss_mb(pid)}
    results: list[RequestResult] = []

    async def run() -> None:
        next_index = 0
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:

            async def worker() -> None:
                nonlocal next_index
                while next_index < len(plan):
                    options, abort = plan[next_index]
                    next_index += 1
                    results.append(await one_request(client, options, abort))
                    if len(results) == WARM_UP:
                        marks["warm"] = rss_mb(pid)

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

    start = time.monotonic()
    asyncio.run(run())
    duration = time.monotonic() - start
    marks["end"] = rss_mb(pid)
    outcomes: dict[str, int] = {}
    for result in results:
        outcomes[result.outcome] = outcomes.get(result.outcome, 0) + 1
    state = server.ready().json()
    print(
        f"\nsoak: {len(results)} requests in {duration:.0f} s ({outcomes}); RSS start "
        f"{marks['start']:.0f} MB, after {WARM_UP} {marks['warm']:.0f} MB, end {marks['end']:.0f} MB "
        f"(growth {marks['end'] - marks['warm']:+.1f} MB); /ready {state}"
    )
    assert len(results) == REQUESTS
    assert set(outcomes) <= {"ok", "aborted"}, outcomes
    assert outcomes.get("aborted", 0) == sum(abort for _, abort in plan)
    assert marks["end"] - marks["warm"] < MAX_GROWTH_MB
    deadline = time.monotonic() + 10
    while (state := server.ready().json())["in_flight"] or state["engine_requests"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
