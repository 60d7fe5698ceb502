"""GET /tts: a WAV for a URL."""

import io
import wave

import httpx
import pytest

from tests.server.audio_check import SECONDS_PER_TOKEN, decode
from tests.server.conftest import ServerProcess

VOICE = "中文女"


def tts(server: ServerProcess, **params: object) -> httpx.Response:
    query = {"text": "你好，世界。", "voice": VOICE, "min_tokens": 25, "max_tokens": 25, "seed": 0} | params
    return httpx.get(f"{server.url}/tts", params=query, timeout=60)


def test_whole_wav(server: ServerProcess) -> None:
    response = tts(server)
    assert response.status_code == 200
    assert response.headers["content-type"] == "audio/wav"
    assert int(response.headers["content-length"]) == len(response.content)
    with wave.open(io.BytesIO(response.content)) as wav:
        assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24000, 1, 2)
        assert wav.getnframes() == 25 * 960
    audio = decode(response.content, "wav")
    assert audio.duration == pytest.approx(25 * SECONDS_PER_TOKEN)


def test_streamed_wav(server: ServerProcess) -> None:
    with httpx.stream(
        "GET",
        f"{server.url}/tts",
        params={"text": "Hi.", "voice": VOICE, "stream": "true", "min_tokens": 80, "max_tokens": 80},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert "content-length" not in response.headers
        data = response.read()
    # Open-ended sizes in the header; independent decoders read to the end of the data.
    assert data[4:8] == b"\xff\xff\xff\xff"
    audio = decode(data, "wav")
    assert (audio.sample_rate, audio.channels, audio.samples) == (24000, 1, 80 * 960)


@pytest.mark.parametrize(
    ("params", "status"),
    [
        ({"text": "x" * 2001}, 400),  # max_text_chars
        ({"text": ""}, 422),
        ({"voice": "nobody"}, 404),
        ({"min_tokens": 0}, 422),
    ],
)
def test_bad_queries(server: ServerProcess, params: dict[str, object], status: int) -> None:
    response = tts(server, **params)
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_without_a_voice_the_default_speaks(server: ServerProcess) -> None:
    """The seed API's load test calls ``/tts?text=...`` alone: the first built-in answers."""
    query = {"text": "你好世界", "seed": 0, "min_tokens": 10, "max_tokens": 10}
    response = httpx.get(f"{server.url}/tts", params=query, timeout=60)
    assert response.status_code == 200, response.text
    named = tts(server, text="你好世界", min_tokens=10, max_tokens=10)
    assert response.content == named.content


@pytest.mark.parametrize(("alias", "builtin"), [("zh_female", "中文女"), ("en_male", "英文男")])
def test_aliases_name_the_built_in_speakers(server: ServerProcess, alias: str, builtin: str) -> None:
    assert tts(server, voice=alias).content == tts(server, voice=builtin).content


def test_longest_allowed_text(server: ServerProcess) -> None:
    assert tts(server, text="啊" * 200, min_tokens=5, max_tokens=5).status_code == 200
