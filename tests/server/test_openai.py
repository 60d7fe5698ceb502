"""POST /v1/audio/speech and GET /v1/models through the openai SDK and httpx."""

import base64
import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.audio_check import SECONDS_PER_TOKEN, decode, pcm16
from tests.server.conftest import ServerProcess

VOICE = "英文男"  # a built-in speaker of the tiny model (sft mode)
TOKENS = 20
FORCED = {"min_tokens": TOKENS, "max_tokens": TOKENS, "seed": 1}
# Lossy codecs add encoder delay and frame padding.
CODEC_SLACK_S = {"wav": 0.0, "pcm": 0.0, "flac": 0.0, "mp3": 0.12, "aac": 0.12, "opus": 0.08}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def busy(server: ServerProcess) -> tuple[int, int]:
    """(requests admitted by the service, requests inside the engine)."""
    body = server.ready().json()
    return int(body["in_flight"]), int(body["engine_requests"])


def wait_idle(server: ServerProcess, timeout: float) -> float:
    """Seconds until the server has no request left; fails after ``timeout``."""
    start = time.monotonic()
    while busy(server) != (0, 0):
        assert time.monotonic() - start < timeout, server.ready().json()
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.parametrize("response_format", ["wav", "mp3", "opus", "aac", "flac", "pcm"])
def test_whole_file_in_every_format(client: openai.OpenAI, response_format: str) -> None:
    response = client.audio.speech.create(
        model="tts-1", input="Hello there.", voice=VOICE, response_format=response_format, extra_body=FORCED
    )
    audio = decode(response.content, response_format)
    expected_rate = 48000 if response_format == "opus" else 24000  # Ogg Opus decodes at 48 kHz
    assert (audio.sample_rate, audio.channels) == (expected_rate, 1)
    expected = TOKENS * SECONDS_PER_TOKEN
    assert expected - 0.01 <= audio.duration <= expected + CODEC_SLACK_S[response_format] + 0.01
    assert response.response.headers["content-type"].startswith(
        {"wav": "audio/wav", "mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac"}.get(
            response_format, f"audio/{response_format}"
        )
    )


def test_wav_header_has_exact_sizes(client: openai.OpenAI) -> None:
    data = client.audio.speech.create(
        model="tts-1", input="Hello.", voice=VOICE, response_format="wav", extra_body=FORCED
    ).content
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    assert int.from_bytes(data[4:8], "little") == len(data) - 8
    assert int.from_bytes(data[40:44], "little") == len(data) - 44 == TOKENS * 960 * 2


@pytest.mark.parametrize(("response_format", "rate"), [("wav", 16000), ("mp3", 44100), ("flac", 8000)])
def test_sample_rate_extension(client: openai.OpenAI, response_format: str, rate: int) -> None:
    body = {**FORCED, "sample_rate": rate}
    data = client.audio.speech.create(
        model="tts-1", input="Hello.", voice=VOICE, response_format=response_format, extra_body=body
    ).content
    audio = decode(data, response_format)
    assert audio.sample_rate == rate
    assert audio.duration == pytest.approx(TOKENS * SECONDS_PER_TOKEN, abs=0.15)


def test_speed_shortens_whole_file_audio(client: openai.OpenAI) -> None:
    data = client.audio.speech.create(
        model="tts-1", input="Hello.", voice=VOICE, response_format="wav", speed=2.0, extra_body=FORCED
    ).content
    assert decode(data, "wav").duration == pytest.approx(TOKENS * SECONDS_PER_TOKEN / 2, abs=0.05)


def test_voice_as_object_and_seed_is_deterministic(client: openai.OpenAI) -> None:
    def speak(seed: int) -> bytes:
        body = {**FORCED, "seed": seed}
        return client.audio.speech.create(
            model="tts-1", input="Hello.", voice={"id": VOICE}, response_format="pcm", extra_body=body
        ).content

    first, again, other = speak(7), speak(7), speak(8)
    assert first == again
    assert first != other
    assert pcm16(first).std() > 0  # not silence


def test_streamed_audio_arrives_in_pieces(client: openai.OpenAI) -> None:
    tokens = 120
    body = {"stream": True, "min_tokens": tokens, "max_tokens": tokens, "seed": 3}
    pieces: list[bytes] = []
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", input="Hello.", voice=VOICE, response_format="pcm", extra_body=body
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        assert "content-length" not in response.headers
        for piece in response.iter_bytes():
            pieces.append(piece)
    data = b"".join(pieces)
    assert len(pieces) > 1
    assert len(data) == tokens * 960 * 2
    # Streaming changes how the audio is made (chunked flow), not how much there is.
    whole = client.audio.speech.create(
        model="tts-1",
        input="Hello.",
        voice=VOICE,
        response_format="pcm",
        extra_body={**body, "stream": False},
    ).content
    assert len(whole) == len(data)


def test_streamed_mp3_decodes(client: openai.OpenAI) -> None:
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        input="Hello.",
        voice=VOICE,
        response_format="mp3",
        extra_body={**FORCED, "stream": True},
    ) as response:
        data = response.read()
    audio = decode(data, "mp3")
    assert (audio.sample_rate, audio.channels) == (24000, 1)
    assert audio.duration == pytest.approx(TOKENS * SECONDS_PER_TOKEN, abs=0.15)


def test_server_sent_events(server: ServerProcess) -> None:
    body = {"model": "tts-1", "input": "Hello.", "voice": VOICE, "response_format": "pcm"}
    body |= {"stream_format": "sse", "min_tokens": 60, "max_tokens": 60}
    events = []
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1
    assert events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert len(audio) == 60 * 960 * 2
    assert events[-1]["usage"]["output_tokens"] == 60
    assert events[-1]["usage"]["total_tokens"] == 60 + events[-1]["usage"]["input_tokens"]


def test_models(client: openai.OpenAI, server: ServerProcess) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]  # the model directory's name


def test_unknown_voice_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.audio.speech.create(model="tts-1", input="Hello.", voice="alloy")
    assert info.value.code == "unknown_voice"
    assert info.value.body == {
        "message": "unknown voice 'alloy'",
        "type": "not_found_error",
        "param": None,
        "code": "unknown_voice",
    }


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"response_format": "ogg"}, 422, "invalid_request"),
        ({"sample_rate": 96000}, 422, "invalid_request"),
        ({"response_format": "mp3", "sample_rate": 20000}, 400, "unsupported_audio_format"),
        ({"input": "x" * 2001}, 400, "invalid_request"),
        ({"input": ""}, 422, "invalid_request"),
        ({"speed": 1.5, "stream": True}, 400, "invalid_request"),
        ({"speed": 3.0}, 400, "invalid_request"),
        ({"instructions": "Speak slowly."}, 400, "invalid_request"),  # sft speakers cannot
        ({"voice": "../etc"}, 400, "invalid_request"),
        ({"min_tokens": 10, "max_tokens": 5}, 400, "invalid_request"),
        ({"unknown_field": 1}, 422, "invalid_request"),
    ],
)
def test_bad_requests(server: ServerProcess, body: dict[str, object], status: int, code: str) -> None:
    request = {"model": "tts-1", "input": "Hello.", "voice": VOICE} | body
    response = httpx.post(f"{server.url}/v1/audio/speech", json=request, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert "Traceback" not in error["message"] and len(error["message"]) < 300


def test_malformed_json_is_422(server: ServerProcess) -> None:
    response = httpx.post(
        f"{server.url}/v1/audio/speech", content=b"{bad", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"]["message"] == "the request body is not valid JSON"


def test_body_over_the_upload_limit_is_413(server: ServerProcess) -> None:
    response = httpx.post(f"{server.url}/v1/audio/speech", content=b"x" * (11 * 1024 * 1024))
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "payload_too_large"


def test_chunked_body_over_the_upload_limit_is_413(server: ServerProcess) -> None:
    def body() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b"x" * (1024 * 1024)
        yield b"x" * 1024

    response = httpx.post(f"{server.url}/v1/audio/speech", content=body(), timeout=60)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "payload_too_large"


def test_disconnect_mid_stream_aborts(server: ServerProcess) -> None:
    """A client that stops reading a long stream frees its engine slot at once."""
    body = {"model": "tts-1", "input": "Hello.", "voice": VOICE, "response_format": "pcm"}
    body |= {"stream": True, "min_tokens": 3000, "max_tokens": 3000}  # two minutes of audio
    with httpx.stream("POST", f"{server.url}/v1/audio/speech", json=body, timeout=60) as response:
        assert response.status_code == 200
        pieces = response.iter_bytes()  # kept: dropping the iterator closes the response
        next(pieces)
        assert busy(server) == (1, 1)
    assert wait_idle(server, timeout=10) < 10


def test_disconnect_while_waiting_for_whole_file_aborts(server: ServerProcess) -> None:
    body = {"model": "tts-1", "input": "Hello.", "voice": VOICE, "response_format": "wav"}
    body |= {"min_tokens": 3000, "max_tokens": 3000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/audio/speech", json=body, timeout=httpx.Timeout(10, read=1.5))
    wait_idle(server, timeout=10)
