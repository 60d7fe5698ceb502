"""``/v1/audio/speech/ws``: the real server with the ``websockets`` client, and the session
logic (pipelining, ordering, limits) on an in-process app with a scripted service."""

import asyncio
import base64
import io
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile
from fastapi import FastAPI
from fastapi.testclient import TestClient
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from cosyserve.engine.async_engine import AudioChunk
from cosyserve.errors import InvalidRequestError
from cosyserve.server.http.routes import ws as routes_ws
from cosyserve.server.service import SpeechParams
from tests.server.conftest import ServerProcess
from tests.server.http_audio import BUILTIN, SAMPLE_RATE, assert_same_pcm, pcm_samples

LONG_TEXT = "One two three four five six seven eight nine ten eleven twelve."
Event = dict[str, Any]


@contextmanager
def session(server: ServerProcess, **config: Any) -> Iterator[ClientConnection]:
    """A configured connection (the ``ready`` event already read)."""
    url = server.url.replace("http://", "ws://") + "/v1/audio/speech/ws"
    with connect(url, open_timeout=30, close_timeout=10) as ws:
        ws.send(json.dumps({"type": "config", "voice": BUILTIN, **config}))
        ready = receive(ws)
        assert ready["type"] == "ready", ready
        yield ws


def receive(ws: ClientConnection, timeout: float = 60) -> Event:
    event: Event = json.loads(ws.recv(timeout=timeout))
    return event


def send(ws: ClientConnection, kind: str, **fields: Any) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


def until(ws: ClientConnection, stop: Any) -> list[Event]:
    """Events up to and including the first one for which ``stop(event)`` holds."""
    events = []
    while True:
        events.append(receive(ws))
        if stop(events[-1]):
            return events


def audio_of(events: list[Event], segment: int | None = None) -> bytes:
    chunks = [e for e in events if e["type"] == "chunk" and (segment is None or e["segment"] == segment)]
    return b"".join(base64.b64decode(e["audio"]) for e in chunks)


def wait_idle(server: ServerProcess, timeout: float = 60) -> None:
    """Until the server has no request in flight (aborted requests are gone)."""
    deadline = time.monotonic() + timeout
    while True:
        ready = server.ready().json()
        if ready["in_flight"] == 0 and ready["engine_requests"] == 0:
            return
        assert time.monotonic() < deadline, f"requests still in flight: {ready}"
        time.sleep(0.05)


# -- the real server ----------------------------------------------------------------------


def test_speech_starts_before_the_text_ends(server: ServerProcess) -> None:
    with session(server, seed=1) as ws:
        send(ws, "text", text="Hello there. How")
        send(ws, "text", text=" are you? I am")
        # Both complete sentences are spoken while the text is still open.
        before_end = until(ws, lambda e: e["type"] == "segment_done" and e["segment"] == 1)
        send(ws, "text", text=" fine")
        send(ws, "end")
        after_end = until(ws, lambda e: e["type"] == "done")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000
    events = before_end + after_end
    assert [e for e in events if e["type"] == "started"] == [
        {"type": "started", "segment": 0, "text": "Hello there."},
        {"type": "started", "segment": 1, "text": "How are you?"},
        {"type": "started", "segment": 2, "text": "I am fine"},
    ]
    assert audio_of(before_end, 0) and audio_of(before_end, 1)
    # Audio comes strictly in order: a sentence's events lie between its started and done.
    order = [e["segment"] for e in events if e["type"] in ("started", "chunk", "segment_done")]
    assert order == sorted(order)
    assert not [e for e in events if e["type"] == "error"]
    # A sentence is synthesised like the same text sent to the HTTP API (to rounding: the
    # session's sentences overlap in the engine, the HTTP request ran alone).
    http = httpx.post(
        f"{server.url}/inference_sft",
        data={"tts_text": "Hello there.", "spk_id": BUILTIN, "seed": "1"},
        timeout=60,
    )
    assert http.status_code == 200
    assert_same_pcm(audio_of(events, 0), http.content)
    assert pcm_samples(audio_of(events)).size > 0


def test_cancel_stops_the_audio(server: ServerProcess) -> None:
    with session(server) as ws:
        send(ws, "text", text=LONG_TEXT + " " + LONG_TEXT + " unfinished")
        until(ws, lambda e: e["type"] == "chunk")
        send(ws, "cancel")
        cancelled = until(ws, lambda e: e["type"] == "cancelled")
        wait_idle(server)  # the sentences in flight were aborted, not left running
        send(ws, "text", text="Bye.")
        send(ws, "end")
        after = until(ws, lambda e: e["type"] == "done")
    spoken_before = {e["segment"] for e in cancelled if e["type"] in ("started", "chunk")}
    started_after = [e for e in after if e["type"] == "started"]
    # Nothing of the cancelled sentences (nor the dropped "unfinished") comes after the cancel.
    assert [e["text"] for e in started_after] == ["Bye."]
    assert all(e["segment"] not in spoken_before for e in after if e["type"] == "chunk")
    assert audio_of(after)


def test_disconnect_aborts_synthesis(server: ServerProcess) -> None:
    with session(server) as ws:
        # Six sentences: random weights may sample the end of a sentence early, and two
        # short ones could both be done before their first chunk reaches this client.
        send(ws, "text", text=" ".join([LONG_TEXT] * 6))
        until(ws, lambda e: e["type"] == "chunk")
        assert server.ready().json()["in_flight"] >= 1
    wait_idle(server)


def test_wav_at_another_rate_is_one_stream(server: ServerProcess) -> None:
    with connect(server.url.replace("http://", "ws://") + "/v1/audio/speech/ws") as ws:
        ws.send(json.dumps({"type": "config", "voice": BUILTIN, "format": "wav", "sample_rate": 16000}))
        assert receive(ws) == {"type": "ready", "format": "wav", "sample_rate": 16000}
        send(ws, "text", text="Hi. Bye.")
        send(ws, "end")
        events = until(ws, lambda e: e["type"] == "done")
    data = audio_of(events)
    assert data[:4] == b"RIFF" and data.count(b"RIFF") == 1  # one header for both sentences
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == 16000 and samples.size > 0


def test_errors_are_events_and_the_session_goes_on(server: ServerProcess) -> None:
    with session(server) as ws:
        ws.send("{not json")
        assert receive(ws) == {
            "type": "error",
            "code": "invalid_message",
            "message": "malformed JSON message",
            "segment": None,
        }
        send(ws, "config", voice=BUILTIN)
        assert receive(ws)["message"] == "the session is already configured"
        send(ws, "text", text=7)
        assert receive(ws)["message"].startswith("invalid text:")
        send(ws, "text", text="… ! ")  # nothing to speak: no sentence, no error
        send(ws, "text", text="Hi.")
        send(ws, "end")
        events = until(ws, lambda e: e["type"] == "done")
    assert [e["text"] for e in events if e["type"] == "started"] == ["Hi."]


OPENING_ERRORS: list[tuple[Any, str, str]] = [
    ({"type": "config", "voice": "nobody"}, "unknown_voice", "unknown voice"),
    ({"type": "config", "voice": "../x"}, "invalid_request", "invalid voice name"),
    (
        {"type": "config", "voice": BUILTIN, "format": "wma"},
        "unsupported_audio_format",
        "unsupported audio format",
    ),
    ({"type": "config", "voice": BUILTIN, "sample_rate": 1000}, "unsupported_audio_format", "sample rate"),
    ({"type": "config", "voice": BUILTIN, "seed": "x"}, "invalid_message", "invalid seed"),
    ({"type": "config", "voice": BUILTIN, "instructions": "快乐"}, "invalid_request", "instructions need"),
    ({"type": "text", "text": "Hi."}, "invalid_message", "first message must be a config"),
    ("[1, 2]", "invalid_message", "type is one of"),
]


@pytest.mark.parametrize(("first", "code", "message"), OPENING_ERRORS)
def test_a_bad_opening_is_an_error_event_then_close(
    server: ServerProcess, first: Any, code: str, message: str
) -> None:
    with connect(server.url.replace("http://", "ws://") + "/v1/audio/speech/ws") as ws:
        ws.send(first if isinstance(first, str) else json.dumps(first))
        event = receive(ws)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert event["type"] == "error" and event["code"] == code
    assert message in event["message"]
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


# -- session logic on a scripted service ----------------------------------------------------


@dataclass
class ScriptedService:
    """Stands in for SpeechService: per sentence, ``chunks`` chunks ``delay`` s apart
    (``slow`` in the text: 5x the delay; ``fail`` in the text: an error after one chunk)."""

    delay: float = 0.02
    chunks: int = 3
    sample_rate: int = SAMPLE_RATE
    log: list[tuple[str, str, float]] = field(default_factory=list)
    active: int = 0
    most_active: int = 0

    def resolve_voice(self, name: str) -> Any:
        return type("Voice", (), {"has_audio_prompt": True})()

    async def synthesize(self, params: SpeechParams) -> AsyncIterator[AudioChunk]:
        self.log.append(("start", params.text, time.monotonic()))
        self.active += 1
        self.most_active = max(self.most_active, self.active)
        try:
            delay = self.delay * (5 if "slow" in params.text else 1)
            for i in range(self.chunks):
                await asyncio.sleep(delay)
                if "fail" in params.text and i == 1:
                    raise InvalidRequestError("scripted failure")
                yield AudioChunk(np.full(100, 0.1 * (i + 1), dtype=np.float32), first=i == 0)
            self.log.append(("end", params.text, time.monotonic()))
        finally:
            self.active -= 1


@dataclass
class ScriptedRuntime:
    service: ScriptedService

    def require_service(self) -> ScriptedService:
        return self.service


@pytest.fixture
def scripted() -> Iterator[tuple[TestClient, ScriptedService]]:
    service = ScriptedService()
    app = FastAPI()
    app.state.runtime = ScriptedRuntime(service)
    app.include_router(routes_ws.router)
    with TestClient(app) as client:
        yield client, service


def test_sentences_are_pipelined_and_sent_in_order(scripted: tuple[TestClient, ScriptedService]) -> None:
    client, service = scripted
    with client.websocket_connect("/v1/audio/speech/ws") as ws:
        ws.send_json({"type": "config", "voice": "v"})
        assert ws.receive_json()["type"] == "ready"
        ws.send_json({"type": "text", "text": "A slow one. Then b. Then c. Then d. "})
        ws.send_json({"type": "end"})
        events = []
        while not events or events[-1]["type"] != "done":
            events.append(ws.receive_json())
    starts = {text: t for kind, text, t in service.log if kind == "start"}
    ends = {text: t for kind, text, t in service.log if kind == "end"}
    # The next sentence synthesises while the slow one is still running ...
    assert starts["Then b."] < ends["A slow one."]
    # ... but never more than PIPELINE_DEPTH at once,
    assert service.most_active == routes_ws.PIPELINE_DEPTH
    # and its audio still comes after the slow one's, which finished later.
    assert ends["Then b."] < ends["A slow one."]
    segments = [e["segment"] for e in events if e["type"] == "chunk"]
    assert segments == sorted(segments) and len(segments) == 4 * service.chunks


def test_a_failing_sentence_is_an_error_event(scripted: tuple[TestClient, ScriptedService]) -> None:
    client, _ = scripted
    with client.websocket_connect("/v1/audio/speech/ws") as ws:
        ws.send_json({"type": "config", "voice": "v"})
        ws.receive_json()
        ws.send_json({"type": "text", "text": "This will fail. This will not."})
        ws.send_json({"type": "end"})
        events = []
        while not events or events[-1]["type"] != "done":
            events.append(ws.receive_json())
    kinds = [(e["type"], e.get("segment")) for e in events]
    assert kinds == [
        ("started", 0),
        ("chunk", 0),
        ("error", 0),
        ("segment_done", 0),
        ("started", 1),
        ("chunk", 1),
        ("chunk", 1),
        ("chunk", 1),
        ("segment_done", 1),
        ("done", None),
    ]
    assert events[2]["message"] == "scripted failure" and events[2]["code"] == "invalid_request"


def test_too_much_pending_text_is_refused(scripted: tuple[TestClient, ScriptedService]) -> None:
    client, service = scripted
    service.delay = 0.2  # slower than the text arrives
    with client.websocket_connect("/v1/audio/speech/ws") as ws:
        ws.send_json({"type": "config", "voice": "v"})
        ws.receive_json()
        ws.send_json({"type": "text", "text": "Go. " * routes_ws.MAX_PENDING_SENTENCES})
        ws.send_json({"type": "text", "text": "One more. "})
        while (event := ws.receive_json())["type"] != "error":
            pass
        assert event["code"] == "too_much_text"
        ws.send_json({"type": "cancel"})
        while ws.receive_json()["type"] != "cancelled":
            pass
        # After the cancel the backlog is gone and text is welcome again.
        ws.send_json({"type": "text", "text": "Hello."})
        ws.send_json({"type": "end"})
        events = []
        while not events or events[-1]["type"] != "done":
            events.append(ws.receive_json())
    assert [e["text"] for e in events if e["type"] == "started"] == ["Hello."]
