"""Bad input, table-driven, against the real server: every row is a 4xx with a stable error
code and message in OpenAI's error shape, never a 500, never internal exception text.

(The WebSocket's bad openings and messages are in ``test_ws.py``: they are events there.)
"""

import io
import re
import wave
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.server.conftest import ServerProcess
from tests.server.http_audio import BUILTIN, PROMPT_TEXT, prompt_wav

MAX_TEXT_CHARS = 2000  # the default of settings.max_text_chars
OVER_UPLOAD_LIMIT = 11 * 1024 * 1024  # the default max_upload_bytes is 10 MiB
# What leaked internals look like: tracebacks, exception class names, source paths.
_LEAK = re.compile(r"Traceback|\b[A-Z]\w*(Error|Exception)\b|File \"|\.py\b|0x[0-9a-f]{6,}")


def speech(**fields: Any) -> dict[str, Any]:
    return {
        "json": {"model": "tts-1", "input": "Hello.", "voice": BUILTIN, "response_format": "pcm", **fields}
    }


def voice_form(name: str = "newvoice", audio: bytes | None = None, **fields: str) -> dict[str, Any]:
    files = {"audio": ("prompt.wav", prompt_wav() if audio is None else audio, "audio/wav")}
    return {"data": {"name": name, "transcript": PROMPT_TEXT, **fields}, "files": files}


def zero_shot(audio: bytes, **fields: str) -> dict[str, Any]:
    files = {"prompt_wav": ("prompt_wav", audio, "application/octet-stream")}
    return {"data": {"tts_text": "Hello.", "prompt_text": PROMPT_TEXT, **fields}, "files": files}


def truncated_wav() -> bytes:
    """A WAV whose header announces 1 s of audio but which holds 0.02 s."""
    return prompt_wav(seconds=1.0)[: 44 + 640]


def long_wav(seconds: float = 31.0) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(prompt_wav(seconds=seconds, rate=8000)[44:])
    return out.getvalue()


def chunked_upload(size: int) -> Iterator[bytes]:
    """A multipart body of one file part of ``size`` bytes, sent chunked (no Content-Length):
    the server can only count it as it arrives."""
    yield b'--xyz\r\nContent-Disposition: form-data; name="prompt_wav"; filename="a.wav"\r\n\r\n'
    for _ in range(size // 65536 + 1):
        yield bytes(65536)


@dataclass(frozen=True)
class Row:
    id: str
    method: str
    path: str
    request: dict[str, Any]
    status: int
    code: str
    message: str  # a part of the error message
    headers: dict[str, str] = field(default_factory=dict)


ROWS = [
    # -- text ----------------------------------------------------------------------------
    Row("empty input", "POST", "/v1/audio/speech", speech(input=""), 422, "invalid_request", "input"),
    Row(
        "blank input",
        "POST",
        "/v1/audio/speech",
        speech(input="   "),
        400,
        "invalid_request",
        "text is empty",
    ),
    Row(
        "oversized input",
        "POST",
        "/v1/audio/speech",
        speech(input="a" * (MAX_TEXT_CHARS + 1)),
        400,
        "invalid_request",
        f"longer than {MAX_TEXT_CHARS}",
    ),
    Row(
        "oversized tts_text",
        "POST",
        "/inference_sft",
        {"data": {"tts_text": "a" * (MAX_TEXT_CHARS + 1), "spk_id": BUILTIN}},
        400,
        "invalid_request",
        "tts_text is too long",
    ),
    Row(
        "empty tts_text",
        "GET",
        "/inference_sft",
        {"params": {"spk_id": BUILTIN}},
        400,
        "invalid_request",
        "tts_text",
    ),
    # -- voices --------------------------------------------------------------------------
    Row(
        "unknown voice",
        "POST",
        "/v1/audio/speech",
        speech(voice="nobody"),
        404,
        "unknown_voice",
        "unknown voice",
    ),
    Row(
        "unknown spk_id",
        "GET",
        "/inference_sft",
        {"params": {"tts_text": "Hi.", "spk_id": "nobody"}},
        404,
        "unknown_voice",
        "unknown voice",
    ),
    Row(
        "voice ../x",
        "POST",
        "/v1/audio/speech",
        speech(voice="../x"),
        400,
        "invalid_request",
        "invalid voice name",
    ),
    Row(
        "register ../x",
        "POST",
        "/v1/audio/voices",
        voice_form("../x"),
        400,
        "invalid_request",
        "invalid voice name",
    ),
    Row(
        "register a/b",
        "POST",
        "/v1/audio/voices",
        voice_form("a/b"),
        400,
        "invalid_request",
        "invalid voice name",
    ),
    Row(
        "register no name",
        "POST",
        "/v1/audio/voices",
        voice_form(""),
        400,
        "invalid_request",
        "name is required",
    ),
    Row("delete a/b", "DELETE", "/v1/audio/voices/a%2Fb", {}, 404, "not_found", "Not Found"),
    Row("delete ..", "DELETE", "/v1/audio/voices/%2E%2E", {}, 400, "invalid_request", "invalid voice name"),
    Row("delete ../x", "DELETE", "/v1/audio/voices/../x", {}, 404, "not_found", "Not Found"),
    Row("delete unknown", "DELETE", "/v1/audio/voices/nobody", {}, 404, "unknown_voice", "unknown voice"),
    # -- formats -------------------------------------------------------------------------
    Row(
        "format wma",
        "POST",
        "/v1/audio/speech",
        speech(response_format="wma"),
        422,
        "invalid_request",
        "response_format",
    ),
    Row(
        "rate 1000",
        "POST",
        "/v1/audio/speech",
        speech(sample_rate=1000),
        422,
        "invalid_request",
        "sample_rate",
    ),
    Row(
        "mp3 at 20 kHz",
        "POST",
        "/v1/audio/speech",
        speech(response_format="mp3", sample_rate=20000),
        400,
        "unsupported_audio_format",
        "not supported for mp3",
    ),
    # -- numbers -------------------------------------------------------------------------
    Row("seed abc", "POST", "/v1/audio/speech", speech(seed="abc"), 422, "invalid_request", "seed"),
    Row(
        "seed abc (upstream)",
        "POST",
        "/inference_sft",
        {"data": {"tts_text": "Hi.", "spk_id": BUILTIN, "seed": "abc"}},
        400,
        "invalid_request",
        "seed must be an integer",
    ),
    Row(
        "seed -1 (upstream)",
        "POST",
        "/inference_sft",
        {"data": {"tts_text": "Hi.", "spk_id": BUILTIN, "seed": "-1"}},
        400,
        "invalid_request",
        "seed must be an integer",
    ),
    Row("speed -1", "POST", "/v1/audio/speech", speech(speed=-1), 422, "invalid_request", "speed"),
    Row(
        "speed 3 (model range)",
        "POST",
        "/v1/audio/speech",
        speech(speed=3.0),
        400,
        "invalid_request",
        "speed must be between",
    ),
    # -- audio uploads -------------------------------------------------------------------
    Row(
        "corrupt audio",
        "POST",
        "/v1/audio/voices",
        voice_form(audio=b"RIFF not really a wav"),
        400,
        "invalid_prompt_audio",
        "could not be decoded",
    ),
    Row(
        "truncated audio",
        "POST",
        "/v1/audio/voices",
        voice_form(audio=truncated_wav()),
        400,
        "invalid_prompt_audio",
        "at least 0.5 s",
    ),
    Row(
        "31 s audio",
        "POST",
        "/v1/audio/voices",
        voice_form(audio=long_wav()),
        400,
        "invalid_prompt_audio",
        "maximum of 30 s",
    ),
    Row(
        "corrupt prompt_wav",
        "POST",
        "/inference_zero_shot",
        zero_shot(b"\x00" * 4000),
        400,
        "invalid_prompt_audio",
        "could not be decoded",
    ),
    Row(
        "prompt_wav as text",
        "POST",
        "/inference_cross_lingual",
        {"data": {"tts_text": "Hi.", "prompt_wav": "x"}},
        400,
        "invalid_request",
        "prompt_wav must be a file upload",
    ),
    Row(
        "oversized upload",
        "POST",
        "/v1/audio/voices",
        voice_form(audio=b"\x00" * OVER_UPLOAD_LIMIT),
        413,
        "payload_too_large",
        "larger than",
    ),
    Row(
        "oversized chunked upload",
        "POST",
        "/inference_zero_shot",
        {"content": chunked_upload(OVER_UPLOAD_LIMIT)},
        413,
        "payload_too_large",
        "larger than",
        {"content-type": "multipart/form-data; boundary=xyz"},
    ),
    # -- bodies --------------------------------------------------------------------------
    Row(
        "voices as JSON",
        "POST",
        "/v1/audio/voices",
        {"json": {"name": "x"}},
        400,
        "invalid_request",
        "unsupported content type",
    ),
    Row(
        "broken multipart",
        "POST",
        "/v1/audio/voices",
        {"content": b"--xyz\r\nnot a part"},
        400,
        "invalid_request",
        "malformed form body",
        {"content-type": "multipart/form-data; boundary=xyz"},
    ),
    Row(
        "malformed JSON",
        "POST",
        "/v1/audio/speech",
        {"content": b"{bad"},
        422,
        "invalid_request",
        "not valid JSON",
        {"content-type": "application/json"},
    ),
    Row(
        "speech as a form",
        "POST",
        "/v1/audio/speech",
        {"data": {"input": "Hi."}},
        422,
        "invalid_request",
        "valid dictionary",
    ),
    Row(
        "instruct v1",
        "POST",
        "/inference_instruct",
        {"data": {"tts_text": "Hi."}},
        400,
        "invalid_request",
        "/inference_instruct2",
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_bad_input_is_a_stable_4xx(server: ServerProcess, row: Row) -> None:
    response = httpx.request(
        row.method, f"{server.url}{row.path}", headers=row.headers, timeout=60, **row.request
    )
    assert response.status_code == row.status, response.text
    error = response.json()["error"]
    assert error["code"] == row.code
    assert row.message in error["message"]
    assert not _LEAK.search(response.text), response.text
    assert len(error["message"]) < 300


def test_the_server_survives_the_table(server: ServerProcess) -> None:
    assert server.ready().status_code == 200
    response = httpx.post(f"{server.url}/v1/audio/speech", timeout=60, **speech(seed=1))
    assert response.status_code == 200 and len(response.content) > 0
