"""Structured logs: request ids, one summary line per request, and no user text."""

import json
import logging
import uuid
from pathlib import Path

import httpx
import pytest

from cosyserve.logging_setup import JsonFormatter, RequestIdFilter, TextFormatter, request_scope
from cosyserve.server.http.request_context import new_request_id
from tests.server.conftest import ServerProcess, running_server

VOICE = "英文男"
FORCED = {"min_tokens": 10, "max_tokens": 10, "seed": 1}


def _record(message: str, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("cosyserve.x", logging.INFO, __file__, 1, message, None, None)
    record.__dict__.update(extra)
    RequestIdFilter().filter(record)
    return record


def test_json_lines_carry_the_request_id_and_extra_fields() -> None:
    with request_scope("abc-123"):
        inside = json.loads(JsonFormatter().format(_record("done", route="/x", status=200)))
    outside = json.loads(JsonFormatter().format(_record("idle")))
    assert inside["request_id"] == "abc-123" and inside["msg"] == "done"
    assert (inside["route"], inside["status"], inside["level"]) == ("/x", 200, "info")
    assert "request_id" not in outside


def test_text_lines_carry_the_request_id_and_extra_fields() -> None:
    with request_scope("r1"):
        line = TextFormatter().format(_record("done", status=503))
    assert "[r1]: done status=503" in line


def test_client_request_ids_are_kept_only_when_sane() -> None:
    assert new_request_id("trace-1.a:b") == "trace-1.a:b"
    for bad in (None, "", "x" * 129, "a b", "a\nb"):
        made = new_request_id(bad)
        assert made != bad and len(made) == 32


def _lines(server: ServerProcess) -> list[dict[str, object]]:
    # Split at newlines only: a logged field may hold other line separators (U+2028,
    # U+0085, ...) that splitlines() would cut a JSON line at (a fuzzed voice name did).
    return [json.loads(line) for line in server.log().split("\n") if line.startswith("{")]


def _speak(server: ServerProcess, text: str, request_id: str) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/audio/speech",
        json={"model": "tts-1", "input": text, "voice": VOICE, "response_format": "pcm", **FORCED},
        headers={"X-Request-ID": request_id},
        timeout=120,
    )


def test_a_request_is_summarised_without_its_text(server: ServerProcess) -> None:
    marker = f"zqx{uuid.uuid4().hex}"
    request_id = f"t-{uuid.uuid4().hex[:8]}"
    response = _speak(server, f"Hello {marker} there.", request_id)
    assert response.status_code == 200 and response.headers["x-request-id"] == request_id
    assert httpx.get(f"{server.url}/health").headers["x-request-id"]  # generated when absent
    assert marker not in server.log_with('"request done"', request_id)
    ours = [line for line in _lines(server) if line.get("request_id") == request_id]
    summary = [line for line in ours if line["msg"] == "request done"]
    assert len(summary) == 1, ours
    (line,) = summary
    assert (line["route"], line["status"], line["voice"]) == ("/v1/audio/speech", 200, VOICE)
    assert line["characters"] == len(f"Hello {marker} there.")
    assert line["audio_s"] == pytest.approx(len(response.content) / 2 / 24000, abs=1e-3)
    assert 0 < float(str(line["first_audio_s"])) <= float(str(line["duration_s"]))
    assert float(str(line["rtf"])) > 0 and "text" not in line


def test_log_text_chars_logs_only_the_first_characters(tiny_model_dir: Path, tmp_path: Path) -> None:
    marker = f"zqx{uuid.uuid4().hex}"
    with running_server(tiny_model_dir, tmp_path, log_text_chars=7) as server:
        assert _speak(server, marker, "chars-1").status_code == 200
        log = server.log_with('"request done"', "chars-1")
    assert marker[:7] in log and marker[:8] not in log
    (summary,) = [json.loads(x) for x in log.split("\n") if '"request done"' in x and "chars-1" in x]
    assert summary["text"] == marker[:7]
