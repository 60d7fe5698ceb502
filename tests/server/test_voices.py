"""``/v1/audio/voices``: register a recording once, use it by name in every mode, delete it;
registered voices survive a restart."""

import hashlib
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient

from cosyserve.server.http.app import create_app
from cosyserve.server.settings import Settings
from tests.server.conftest import ServerProcess
from tests.server.http_audio import BUILTIN, PROMPT_TEXT, assert_speechlike_pcm, prompt_wav

TEXT = "Hi."  # short: random weights speak up to 20 speech tokens per text token
INSTRUCTION = "用开心的语气说"
SEED = "7"


def register(base: str | httpx.Client, name: str, audio: bytes, transcript: str | None) -> httpx.Response:
    data = {"name": name} if transcript is None else {"name": name, "transcript": transcript}
    files = {"audio": ("prompt.wav", audio, "audio/wav")}
    if isinstance(base, httpx.Client):
        return base.post("/v1/audio/voices", data=data, files=files)
    return httpx.post(f"{base}/v1/audio/voices", data=data, files=files, timeout=60)


def speech(server: ServerProcess, voice: str, **extra: Any) -> httpx.Response:
    body = {"model": "cosyvoice2", "input": TEXT, "voice": voice, "response_format": "pcm", "stream": True}
    return httpx.post(f"{server.url}/v1/audio/speech", json={**body, **extra}, timeout=60)


def upstream(server: ServerProcess, endpoint: str, audio: bytes, **fields: str) -> httpx.Response:
    files = {"prompt_wav": ("prompt_wav", audio, "application/octet-stream")}
    data = {"tts_text": TEXT, "seed": SEED, **fields}
    return httpx.post(f"{server.url}/{endpoint}", data=data, files=files, timeout=60)


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def listed(base: str) -> dict[str, dict[str, Any]]:
    response = httpx.get(f"{base}/v1/audio/voices", timeout=10)
    assert response.status_code == 200
    return {v["name"]: v for v in response.json()["voices"]}


def test_register_and_list(server: ServerProcess) -> None:
    name, audio = unique("alice"), prompt_wav(seed=1)
    before = time.time()
    response = register(server.url, name, audio, PROMPT_TEXT)
    assert response.status_code == 201, response.text
    info = response.json()
    assert info["name"] == name and info["kind"] == "registered"
    assert info["sha256"] == hashlib.sha256(audio).hexdigest()
    assert before - 2 <= info["created_at"] <= time.time() + 2
    assert info["modes"] == ["zero_shot", "cross_lingual", "instruct2", "sft"]
    voices = listed(server.url)
    assert voices[name] == info
    assert voices[BUILTIN]["kind"] == "builtin" and voices[BUILTIN]["modes"] == ["sft"]


def test_registered_voice_sounds_like_its_prompt_in_every_mode(server: ServerProcess) -> None:
    """A registered voice gives exactly the audio of its recording passed inline, in
    zero_shot (transcript), instruct2 (instructions) and cross_lingual (no transcript)."""
    audio = prompt_wav(seed=2)
    with_text, without_text = unique("zs"), unique("xl")
    assert register(server.url, with_text, audio, PROMPT_TEXT).status_code == 201
    created = register(server.url, without_text, audio, None)
    assert created.status_code == 201
    assert "zero_shot" not in created.json()["modes"]
    cases = [
        (
            speech(server, with_text, seed=int(SEED)),
            upstream(server, "inference_zero_shot", audio, prompt_text=PROMPT_TEXT),
        ),
        (
            speech(server, with_text, seed=int(SEED), instructions=INSTRUCTION),
            upstream(server, "inference_instruct2", audio, instruct_text=INSTRUCTION),
        ),
        (speech(server, without_text, seed=int(SEED)), upstream(server, "inference_cross_lingual", audio)),
    ]
    for by_name, inline in cases:
        assert by_name.status_code == 200 and inline.status_code == 200, (by_name.text, inline.text)
        assert_speechlike_pcm(by_name.content)
        assert by_name.content == inline.content
    # zero_shot needs a transcript: the voice registered without one cannot be cloned that way.
    assert (
        speech(server, with_text, seed=int(SEED)).content
        != speech(server, without_text, seed=int(SEED)).content
    )


def test_duplicates_and_deletion(server: ServerProcess) -> None:
    name, audio = unique("bob"), prompt_wav(seed=3)
    assert register(server.url, name, audio, PROMPT_TEXT).status_code == 201
    duplicate = register(server.url, name, audio, PROMPT_TEXT)
    assert duplicate.status_code == 409
    assert duplicate.json()["error"]["code"] == "voice_exists"
    assert register(server.url, BUILTIN, audio, PROMPT_TEXT).status_code == 409  # built-in names are taken

    assert httpx.delete(f"{server.url}/v1/audio/voices/{name}").status_code == 204
    assert name not in listed(server.url)
    gone = httpx.delete(f"{server.url}/v1/audio/voices/{name}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_voice"
    assert speech(server, name).status_code == 404
    builtin = httpx.delete(f"{server.url}/v1/audio/voices/{BUILTIN}")
    assert builtin.status_code == 400 and "built in" in builtin.json()["error"]["message"]


def test_registered_voices_survive_a_restart(server: ServerProcess, tiny_model_dir: Path) -> None:
    """Register on the running server; a second server on the same database file (as after
    a restart) lists the voices unchanged and synthesises the same audio from them."""
    names = {unique("keep"): PROMPT_TEXT, unique("keep_xl"): None}
    expected = {}
    for name, transcript in names.items():
        assert register(server.url, name, prompt_wav(seed=4), transcript).status_code == 201
        expected[name] = (listed(server.url)[name], speech(server, name, seed=3).content)
    settings = Settings.load(
        model_dir=tiny_model_dir,
        voices_db=server.log_path.parent / "voices.sqlite3",
        grpc_port=0,
        auth_mode="none",
        profile="exact",  # the first server's plan (tests/server/conftest.py), so the same audio
    )
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 120
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the second server did not get ready"
            time.sleep(0.1)
        voices = {v["name"]: v for v in client.get("/v1/audio/voices").json()["voices"]}
        for name, (info, audio) in expected.items():
            assert voices[name] == info
            again = client.post(
                "/v1/audio/speech",
                json={
                    "model": "m",
                    "input": TEXT,
                    "voice": name,
                    "response_format": "pcm",
                    "stream": True,
                    "seed": 3,
                },
            )
            assert again.status_code == 200
            assert again.content == audio
