"""Upstream CosyVoice's FastAPI endpoints on the real server, called exactly the way
upstream's ``runtime/python/fastapi/client.py`` calls them:

    requests.request("GET", url, data=payload, files=files, stream=True)
    for r in response.iter_content(chunk_size=16000): tts_audio += r

(``files`` only for the prompt endpoints: ``[('prompt_wav', ('prompt_wav', <file>,
'application/octet-stream'))]``). httpx's ``Client.stream`` with ``data``/``files`` sends the
same request: a form body, multipart with the file, url-encoded without.
"""

from typing import Any

import httpx
import pytest

from tests.server.conftest import ServerProcess
from tests.server.http_audio import BUILTIN, PROMPT_TEXT, assert_speechlike_pcm, pcm_samples, prompt_wav

TEXT = "Hello there."  # short: random weights speak up to 20 tokens per text token
# One speech token's audio (40 ms). Upstream's client sends no seed, and below the minimum
# length only eos is masked, as upstream does: random weights can sample another stop id
# after a token or two (seen once in CI, 2026-12-06: 1920 samples).
ONE_TOKEN_S = 0.04


def upstream_client(
    server: ServerProcess, endpoint: str, payload: dict[str, str], *, with_prompt: bool, method: str = "GET"
) -> tuple[httpx.Response, list[bytes]]:
    """The request of upstream's client.py; returns the response and the body's pieces."""
    files = (
        [("prompt_wav", ("prompt_wav", prompt_wav(), "application/octet-stream"))] if with_prompt else None
    )
    with (
        httpx.Client(timeout=60) as client,
        client.stream(method, f"{server.url}/{endpoint}", data=payload, files=files) as response,
    ):
        pieces = list(response.iter_bytes()) if response.status_code == 200 else [response.read()]
    return response, pieces


CASES: list[tuple[str, dict[str, str], bool]] = [
    ("inference_sft", {"tts_text": TEXT, "spk_id": BUILTIN}, False),
    ("inference_zero_shot", {"tts_text": TEXT, "prompt_text": PROMPT_TEXT}, True),
    ("inference_cross_lingual", {"tts_text": TEXT}, True),
    ("inference_instruct2", {"tts_text": TEXT, "instruct_text": "用四川话说这句话"}, True),
]


@pytest.mark.parametrize(("endpoint", "payload", "with_prompt"), CASES, ids=[c[0] for c in CASES])
def test_upstream_client_request_streams_pcm(
    server: ServerProcess, endpoint: str, payload: dict[str, str], with_prompt: bool
) -> None:
    response, pieces = upstream_client(server, endpoint, payload, with_prompt=with_prompt)
    assert response.status_code == 200, pieces
    assert response.headers["content-type"] == "audio/pcm"
    assert_speechlike_pcm(b"".join(pieces), min_seconds=ONE_TOKEN_S)


def test_audio_is_sent_as_it_is_made(server: ServerProcess) -> None:
    # Long enough for several streaming chunks (the first hop is about 25 tokens, 1 s).
    payload = {"tts_text": "One two three four five.", "spk_id": BUILTIN, "seed": "3"}
    response, pieces = upstream_client(server, "inference_sft", payload, with_prompt=False)
    assert response.status_code == 200
    samples = assert_speechlike_pcm(b"".join(pieces), min_seconds=1.5)
    assert len([p for p in pieces if p]) > 1, f"{samples.size} samples came as one piece"


def test_post_and_query_string_work_too(server: ServerProcess) -> None:
    posted, pieces = upstream_client(
        server,
        "inference_sft",
        {"tts_text": TEXT, "spk_id": BUILTIN, "seed": "5"},
        with_prompt=False,
        method="POST",
    )
    assert posted.status_code == 200
    query = httpx.get(
        f"{server.url}/inference_sft", params={"tts_text": TEXT, "spk_id": BUILTIN, "seed": "5"}, timeout=60
    )
    assert query.status_code == 200
    # Same seed, same request: the same samples, whichever way the fields came.
    assert query.content == b"".join(pieces)


def test_seed_makes_prompt_audio_reproducible(server: ServerProcess) -> None:
    # Without the seed reaching the engine, two requests would draw different audio.
    payload = {"tts_text": TEXT, "prompt_text": PROMPT_TEXT, "seed": "11"}
    first = b"".join(upstream_client(server, "inference_zero_shot", payload, with_prompt=True)[1])
    again = b"".join(upstream_client(server, "inference_zero_shot", payload, with_prompt=True)[1])
    assert pcm_samples(first).size > 0
    assert first == again


ERRORS: list[tuple[str, dict[str, Any], bool, int, str, str]] = [
    (
        "inference_instruct",
        {"tts_text": TEXT, "spk_id": BUILTIN},
        False,
        400,
        "invalid_request",
        "/inference_instruct2",
    ),
    ("inference_sft", {"tts_text": TEXT}, False, 400, "invalid_request", "spk_id is required"),
    ("inference_sft", {"spk_id": BUILTIN}, False, 400, "invalid_request", "tts_text is required"),
    ("inference_sft", {"tts_text": TEXT, "spk_id": "nobody"}, False, 404, "unknown_voice", "unknown voice"),
    ("inference_zero_shot", {"tts_text": TEXT}, True, 400, "invalid_request", "prompt_text is required"),
    (
        "inference_zero_shot",
        {"tts_text": TEXT, "prompt_text": "hi"},
        False,
        400,
        "invalid_request",
        "prompt_wav",
    ),
    ("inference_instruct2", {"tts_text": TEXT}, True, 400, "invalid_request", "instruct_text is required"),
]


@pytest.mark.parametrize(("endpoint", "payload", "with_prompt", "status", "code", "message"), ERRORS)
def test_errors_are_json_with_a_status(
    server: ServerProcess,
    endpoint: str,
    payload: dict[str, str],
    with_prompt: bool,
    status: int,
    code: str,
    message: str,
) -> None:
    response, pieces = upstream_client(server, endpoint, payload, with_prompt=with_prompt)
    assert response.status_code == status
    error = httpx.Response(status, content=b"".join(pieces)).json()["error"]
    assert error["code"] == code
    assert message in error["message"]
