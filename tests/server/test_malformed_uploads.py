"""A corpus of malformed prompt recordings, uploaded to voice registration and to upstream's
``/inference_zero_shot``: every one is a 4xx with a JSON error, never a 5xx, and no voice
is left registered."""

import random
import struct

import httpx
import pytest

from tests.server.conftest import ServerProcess
from tests.server.http_audio import PROMPT_TEXT, prompt_wav


def _wav_header(
    *, channels: int = 1, rate: int = 16000, bits: int = 16, data_size: int = 32000, fmt_tag: int = 1
) -> bytes:
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", fmt_tag, channels, rate, (rate * block) & 0xFFFFFFFF, block, bits)
    return (
        b"RIFF"
        + struct.pack("<I", 36 + data_size)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", data_size)
    )


def _corpus() -> dict[str, bytes]:
    good = prompt_wav(seconds=1.0)
    rng = random.Random(7)
    noise = bytes(rng.getrandbits(8) for _ in range(4000))
    return {
        "empty": b"",
        "truncated_wav": good[:60],
        "header_only": good[:44],
        "wrong_magic": b"RIFX" + good[4:8] + b"WAVX" + good[12:],
        "huge_sample_rate": _wav_header(rate=0xFFFFFFFF) + good[44:],
        "zero_sample_rate": _wav_header(rate=0) + good[44:],
        "zero_channels": _wav_header(channels=0) + good[44:],
        "zero_bits": _wav_header(bits=0) + good[44:],
        "unknown_codec": _wav_header(fmt_tag=0x1234) + good[44:],
        "huge_declared_size": _wav_header(data_size=0xFFFFFFD0) + good[44:1044],
        "random_bytes": noise,
        "mp3_garbage": b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"\xff\xfb\x90\x64" + noise,
        "mp3_frames_garbage": (b"\xff\xfb\x90\x64" + noise[:413]) * 4,
        "text_as_audio": b"hello, this is not audio at all\n" * 20,
    }


CORPUS = _corpus()
CASES = sorted(CORPUS)


def _assert_client_error(response: httpx.Response, name: str) -> None:
    assert 400 <= response.status_code < 500, (name, response.status_code, response.text)
    assert isinstance(response.json(), dict), response.text


@pytest.mark.parametrize("name", CASES)
def test_voice_registration_refuses(server: ServerProcess, name: str) -> None:
    voice = f"bad_{name}"
    response = httpx.post(
        f"{server.url}/v1/audio/voices",
        data={"name": voice, "transcript": PROMPT_TEXT},
        files={"audio": ("prompt.wav", CORPUS[name], "audio/wav")},
        timeout=60,
    )
    _assert_client_error(response, name)
    listed = httpx.get(f"{server.url}/v1/audio/voices", timeout=10).json()["voices"]
    assert voice not in {v["name"] for v in listed}


@pytest.mark.parametrize("name", CASES)
def test_zero_shot_refuses(server: ServerProcess, name: str) -> None:
    response = httpx.post(
        f"{server.url}/inference_zero_shot",
        data={"tts_text": "Hello.", "prompt_text": PROMPT_TEXT},
        files={"prompt_wav": ("prompt_wav", CORPUS[name], "application/octet-stream")},
        timeout=60,
    )
    _assert_client_error(response, name)
