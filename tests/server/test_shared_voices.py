"""Replicas on one PostgreSQL voice database: a voice registered on one server is listed,
spoken, refused as a duplicate and deleted on another at once. A slow database holds only
the calls that need it. While the database is down, every voice call answers a clean 503
(a stable code and message, no internals), requests that bring their own prompt audio
still work, and the servers recover once it is back."""

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import psycopg

from tests.postgres import PostgresServer
from tests.server.conftest import ServerProcess, running_server, stop_server
from tests.server.http_audio import PROMPT_TEXT, assert_speechlike_pcm, prompt_wav
from tests.server.test_voices import listed, register, speech, unique, upstream

UNAVAILABLE = "the voice database is unavailable"


@contextmanager
def _replicas(model_dir: Path, tmp: Path, count: int, voices_db: str) -> Iterator[list[ServerProcess]]:
    """``count`` servers on one voice database, started and stopped at once (start-up and
    drain are most of this test's time); every one is stopped, also when another failed to
    start (``running_server`` stops its own; a stopped server's stop is a no-op)."""
    with ExitStack() as stack, ThreadPoolExecutor(count) as pool:
        starts = [
            pool.submit(stack.enter_context, running_server(model_dir, tmp / f"r{i}", voices_db=voices_db))
            for i in range(count)
        ]
        servers = [start.result() for start in starts]
        try:
            yield servers
        finally:
            list(pool.map(stop_server, [server.process for server in servers]))


def _assert_clean_503(response: httpx.Response, *internals: str) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) >= 1
    error = {"message": UNAVAILABLE, "type": "server_error", "param": None, "code": "voice_store_unavailable"}
    assert response.json() == {"error": error}
    for text in internals:
        assert text not in response.text


def _assert_a_slow_database_holds_only_its_own_calls(server: ServerProcess, url: str) -> None:
    """While a voice listing waits for a locked table, the server goes on answering others
    (the store is called off the event loop), and the listing completes once it is unlocked."""
    with ThreadPoolExecutor(1) as client, psycopg.connect(url, autocommit=True) as admin:
        with psycopg.connect(url) as locker:  # a transaction: the lock holds until it ends
            locker.execute("LOCK TABLE cosyserve_voices IN ACCESS EXCLUSIVE MODE")
            listing = client.submit(httpx.get, f"{server.url}/v1/audio/voices", timeout=30)
            waiting = (
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            deadline = time.monotonic() + 20
            while admin.execute(waiting).fetchone() != (1,):
                assert time.monotonic() < deadline and not listing.done()
                time.sleep(0.02)
            started = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
            assert time.monotonic() - started < 2 and not listing.done()
        assert listing.result().status_code == 200


def test_replicas_share_registered_voices_and_survive_an_outage(
    tiny_model_dir: Path, tmp_path: Path, postgres: PostgresServer
) -> None:
    role = f"replicas_{uuid.uuid4().hex[:8]}"
    url = postgres.new_database(owner=role)
    password = url.split("@", 1)[0].rsplit(":", 1)[1]
    name, audio = unique("shared"), prompt_wav(seed=5)
    with _replicas(tiny_model_dir, tmp_path, 2, url) as (first, second):
        assert register(first.url, name, audio, PROMPT_TEXT).status_code == 201
        entry = listed(second.url)[name]
        assert entry == listed(first.url)[name]
        assert entry["kind"] == "registered" and "zero_shot" in entry["modes"]
        spoken = speech(second, name, seed=3)
        assert spoken.status_code == 200
        assert_speechlike_pcm(spoken.content)

        duplicate = register(second.url, name, audio, PROMPT_TEXT)
        assert duplicate.status_code == 409 and duplicate.json()["error"]["code"] == "voice_exists"

        builtin = next(n for n, v in listed(first.url).items() if v["kind"] == "builtin")
        _assert_a_slow_database_holds_only_its_own_calls(first, url)

        with postgres.outage(role):
            # What a server knows of the database must not reach a client.
            internals = (role, str(postgres.port), "psycopg", "Traceback", "postgresql", password)
            _assert_clean_503(httpx.get(f"{first.url}/v1/audio/voices", timeout=30), *internals)
            _assert_clean_503(speech(second, name), *internals)
            _assert_clean_503(register(first.url, unique("new"), audio, PROMPT_TEXT), *internals)
            _assert_clean_503(httpx.delete(f"{second.url}/v1/audio/voices/{name}", timeout=30), *internals)
            # Built-in voices and prompt audio in the request need no database; the servers
            # stay ready.
            assert speech(first, builtin).status_code == 200
            own_prompt = upstream(first, "inference_zero_shot", audio, prompt_text=PROMPT_TEXT)
            assert own_prompt.status_code == 200
            assert_speechlike_pcm(own_prompt.content)
            assert first.ready().status_code == 200 and second.ready().status_code == 200

        # Back: both reconnect on their next call. The same features from the database,
        # the same plan and seed: the first server speaks the voice as the second did.
        assert name in listed(first.url) and name in listed(second.url)
        assert speech(first, name, seed=3).content == spoken.content

        assert httpx.delete(f"{second.url}/v1/audio/voices/{name}", timeout=10).status_code == 204
        assert name not in listed(first.url)
        assert speech(first, name).status_code == 404
    logs = first.log() + second.log()
    shown = f"postgresql://{role}:***@127.0.0.1:{postgres.port}/"
    assert f"voices: {shown}" in logs  # the start-up line
    assert f"voice database {shown}" in logs and "unavailable" in logs  # the outage's lines
    assert password not in logs and PROMPT_TEXT not in logs
