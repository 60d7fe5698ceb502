"""``cosyserve bench server`` against the real server (tiny model, capacity 4): the report
counts what the server did, and the overload and disconnect figures hold under its load."""

import io
import json
import time
import wave
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cosyserve.bench.server_load import LoadOptions, run_server_load, wav_seconds
from cosyserve.cli.main import app
from tests.server.conftest import ServerProcess
from tests.server.http_audio import BUILTIN, SAMPLE_RATE

# Target 100 ms; the bound allows for a shared 2-core machine (see test_admission.py).
REFUSAL_BUDGET_S = 1.0


def _wav(samples: int, rate: int = SAMPLE_RATE) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x01\x00" * samples)
    return out.getvalue()


def test_wav_seconds_counts_the_bytes_present() -> None:
    assert wav_seconds(_wav(12000)) == pytest.approx(0.5)
    streamed = bytearray(_wav(0))
    streamed[40:44] = b"\xff\xff\xff\xff"  # a streamed WAV's placeholder data size
    assert wav_seconds(bytes(streamed) + b"\x00\x00" * 6000) == pytest.approx(0.25)
    assert wav_seconds(b"ID3 not a wav file") is None


def test_bench_server_command_reports_the_audio(server: ServerProcess, tmp_path: Path) -> None:
    tokens, requests = 10, 3
    args = ["bench", "server", "--url", server.url, "--concurrency", "1,2", "--requests", str(requests)]
    args += ["--voice", BUILTIN, "--tokens", str(tokens), "--format", "wav", "--no-progress"]
    args += ["--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert (level["ok"], level["errors"]) == (requests, {})
        audio = level["audio_s_per_s"] * level["wall_s"]  # decoded from the WAV bodies
        assert audio == pytest.approx(requests * tokens / 25, rel=1e-3)
        assert 0 < level["first_byte_s"]["p50"] <= level["total_s"]["p50"]
    assert (tmp_path / "r.md").read_text() == result.output
    assert "| 2 | 3 | 0 | 0 |" in result.output


def test_upstream_api(server: ServerProcess) -> None:
    options = LoadOptions(url=server.url, concurrency=(2,), requests=2, api="upstream", voice=BUILTIN)
    level = run_server_load(options).levels[0]
    assert (level.ok, level.errors) == (2, {})
    assert level.audio_s_per_s is not None and level.audio_s_per_s > 0


def test_overload_under_load(server: ServerProcess) -> None:
    capacity = server.ready().json()["capacity"]
    tokens = 50
    options = LoadOptions(
        url=server.url,
        concurrency=(4 * capacity,),
        requests=4 * capacity,
        stream=True,
        format="pcm",
        voice=BUILTIN,
        tokens=tokens,
    )
    level = run_server_load(options).levels[0]
    assert (level.ok, level.errors) == (capacity, {"429": 3 * capacity})
    assert level.audio_s_per_s is not None  # every admitted request ran to its end:
    assert level.audio_s_per_s * level.wall_s == pytest.approx(capacity * tokens / 25)
    assert level.max_refusal_s is not None and level.total_s is not None and level.refusal_s is not None
    print(
        f"\n{4 * capacity} clients, capacity {capacity}: 429 after p50 "
        f"{level.refusal_s.p50 * 1000:.0f} ms, max {level.max_refusal_s * 1000:.0f} ms; "
        f"served in {level.total_s.p50:.2f} s (p50)"
    )
    assert level.max_refusal_s < REFUSAL_BUDGET_S


def test_aborted_streams_leave_nothing_behind(server: ServerProcess) -> None:
    capacity = server.ready().json()["capacity"]
    options = LoadOptions(
        url=server.url,
        concurrency=(capacity,),
        requests=3 * capacity,
        stream=True,
        format="pcm",
        voice=BUILTIN,
        tokens=2000,
        abort_fraction=1.0,
    )
    level = run_server_load(options).levels[0]
    # A slot is freed when the server notices the disconnect, a moment after the client
    # left: a worker's immediate next request may meet a 429, never another error.
    assert set(level.errors) <= {"429"} and level.aborted >= capacity, level
    assert level.aborted + level.errors.get("429", 0) == 3 * capacity
    deadline = time.monotonic() + 10
    while (state := server.ready().json())["in_flight"] or state["engine_requests"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.05)


def test_asked_sample_rate(server: ServerProcess) -> None:
    options = LoadOptions(
        url=server.url,
        concurrency=(1,),
        requests=1,
        format="pcm",
        voice=BUILTIN,
        tokens=10,
        sample_rate=16000,
    )
    level = run_server_load(options).levels[0]
    assert level.audio_s_per_s is not None  # 10 tokens = 0.4 s, measured at the asked rate
    assert level.audio_s_per_s * level.wall_s == pytest.approx(0.4)
