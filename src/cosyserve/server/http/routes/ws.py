"""``/v1/audio/speech/ws``: text in as an LLM writes it, audio out as it is made.

The protocol (messages, events, the audio encoding) is described in
:mod:`cosyserve.server.http.ws_protocol`. How a session runs:

* incoming text is cut into sentences (:class:`~cosyserve.server.text_buffer.SentenceBuffer`);
  each complete sentence starts synthesising at once, as its own request, while more text
  arrives; at most :data:`PIPELINE_DEPTH` sentences of a session synthesise at a time;
* one sender task forwards the sentences' audio strictly in order, through one encoder,
  so the chunks of a session form one continuous stream in the chosen format;
* ``cancel`` aborts every sentence in flight and drops buffered text; the session goes on;
* a disconnect aborts everything; a failing sentence is an ``error`` event and the
  session continues with the next one.
"""

import asyncio
import base64
import contextlib
import logging
from dataclasses import dataclass, field

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from starlette.websockets import WebSocketState

from cosyserve.audio import AudioEncoder, create_encoder
from cosyserve.errors import CosyserveError, InvalidRequestError
from cosyserve.pipeline.request import SynthesisOptions
from cosyserve.server.error_map import map_error
from cosyserve.server.http.ws_protocol import (
    CancelledEvent,
    CancelMessage,
    ChunkEvent,
    ConfigMessage,
    DoneEvent,
    EndMessage,
    ErrorEvent,
    FlushMessage,
    InvalidMessageError,
    ReadyEvent,
    SegmentDoneEvent,
    ServerEvent,
    StartedEvent,
    TextMessage,
    parse_client_message,
)
from cosyserve.server.runtime import ServerRuntime
from cosyserve.server.service import SpeechParams, SpeechService
from cosyserve.server.text_buffer import SentenceBuffer

logger = logging.getLogger(__name__)

router = APIRouter(tags=["speech"])

# Sentences of one session synthesising at once: the one being sent and the next, so the
# next sentence's first audio is ready when the current one ends.
PIPELINE_DEPTH = 2
# Sentences of one session made and not yet sent; past it text is refused until audio
# catches up, so a client cannot queue unbounded work.
MAX_PENDING_SENTENCES = 64
# Seconds a new connection has to send its config message.
CONFIG_TIMEOUT_S = 30.0
# WebSocket close codes (RFC 6455 7.4.1).
_CLOSE_NORMAL = 1000
_CLOSE_POLICY = 1008


class TooMuchTextError(InvalidRequestError):
    code = "too_much_text"


@dataclass(eq=False)
class _End:
    """The last item of a sentence's audio queue; ``error`` if it failed."""

    error: BaseException | None = None


@dataclass(eq=False)
class _Sentence:
    index: int
    text: str
    audio: "asyncio.Queue[np.ndarray | _End]" = field(default_factory=asyncio.Queue)


class _Session:
    """One WebSocket connection after its config message."""

    def __init__(
        self, ws: WebSocket, service: SpeechService, config: ConfigMessage, encoder: AudioEncoder
    ) -> None:
        self.ws = ws
        self.service = service
        self.config = config
        self.encoder = encoder
        self.buffer = SentenceBuffer()
        self.slots = asyncio.Semaphore(PIPELINE_DEPTH)
        self.send_lock = asyncio.Lock()
        self.next_index = 0
        self.pending = 0  # sentences made and not yet completely sent
        self.ended = False
        self.finished = asyncio.Event()
        self.queue: asyncio.Queue[_Sentence | None] = asyncio.Queue()
        self.producers: set[asyncio.Task[None]] = set()
        self.sender = asyncio.create_task(self._send_all(self.queue))

    # -- input ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Handle client messages until the session is done or the client leaves."""
        receiver = asyncio.create_task(self._receive_all())
        finished = asyncio.create_task(self.finished.wait())
        try:
            await asyncio.wait({receiver, finished}, return_when=asyncio.FIRST_COMPLETED)
            if receiver.done():
                receiver.result()  # re-raise a failure of the receive loop
        finally:
            receiver.cancel()
            finished.cancel()
            await self._stop()
            self.encoder.close()

    async def _receive_all(self) -> None:
        while (raw := await _receive_frame(self.ws)) is not None:
            try:
                message = parse_client_message(raw)
            except InvalidMessageError as exc:
                await self._error(exc)
                continue
            if isinstance(message, CancelMessage):
                await self._cancel()
            elif self.ended:
                await self._error(InvalidMessageError("the session has ended"))
            elif isinstance(message, ConfigMessage):
                await self._error(InvalidMessageError("the session is already configured"))
            elif isinstance(message, EndMessage):
                self._speak(self.buffer.flush())
                self.ended = True
                self.queue.put_nowait(None)
            elif self.pending >= MAX_PENDING_SENTENCES:
                await self._error(
                    TooMuchTextError(
                        f"{MAX_PENDING_SENTENCES} sentences are waiting to be spoken; "
                        "send more text once their audio has arrived"
                    )
                )
            elif isinstance(message, TextMessage):
                self._speak(self.buffer.push(message.text))
            elif isinstance(message, FlushMessage):
                self._speak(self.buffer.flush())

    def _speak(self, sentences: list[str]) -> None:
        for text in sentences:
            sentence = _Sentence(self.next_index, text)
            self.next_index += 1
            self.pending += 1
            task = asyncio.create_task(self._synthesize(sentence))
            self.producers.add(task)
            task.add_done_callback(self.producers.discard)
            self.queue.put_nowait(sentence)

    async def _synthesize(self, sentence: _Sentence) -> None:
        """Run one sentence's synthesis into its queue (a producer)."""
        params = SpeechParams(
            text=sentence.text,
            voice=self.config.voice,
            instruct=self.config.instructions,
            options=SynthesisOptions(seed=self.config.seed),
        )
        end = _End()
        try:
            async with self.slots:
                async for chunk in self.service.synthesize(params):
                    sentence.audio.put_nowait(chunk.audio)
        except CosyserveError as exc:
            end.error = exc
        except Exception as exc:  # a bug: this sentence fails, not the session
            logger.exception("synthesis of a WebSocket sentence failed")
            end.error = exc
        finally:
            sentence.audio.put_nowait(end)

    async def _cancel(self) -> None:
        """Abort every sentence in flight and drop buffered text; the session continues
        (or, after ``end``, finishes)."""
        self.buffer.clear()
        await self._stop()
        self.pending = 0
        await self.send(CancelledEvent())
        self.queue = asyncio.Queue()
        if self.ended:
            self.queue.put_nowait(None)
        self.sender = asyncio.create_task(self._send_all(self.queue))

    async def _stop(self) -> None:
        """Stop the sender, then every producer (leaving ``service.synthesize`` aborts
        its engine request)."""
        self.sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.sender
        tasks = list(self.producers)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- output -----------------------------------------------------------------------------

    async def _send_all(self, queue: "asyncio.Queue[_Sentence | None]") -> None:
        """Forward sentences' audio in order; after the end marker, finish the stream."""
        try:
            while (sentence := await queue.get()) is not None:
                await self._send_sentence(sentence)
                self.pending -= 1
            tail = self.encoder.finish()
            if tail:
                await self.send(ChunkEvent(segment=None, audio=_b64(tail)))
            await self.send(DoneEvent())
        except asyncio.CancelledError:
            raise
        except Exception:  # the client is gone (or a bug): the session is over either way
            logger.debug("WebSocket sender stopped", exc_info=True)
        self.finished.set()

    async def _send_sentence(self, sentence: _Sentence) -> None:
        await self.send(StartedEvent(segment=sentence.index, text=sentence.text))
        while not isinstance(item := await sentence.audio.get(), _End):
            data = self.encoder.encode(item)
            if data:
                await self.send(ChunkEvent(segment=sentence.index, audio=_b64(data)))
        if item.error is not None:
            await self._error(item.error, sentence.index)
        await self.send(SegmentDoneEvent(segment=sentence.index))

    async def _error(self, exc: BaseException, segment: int | None = None) -> None:
        mapped = map_error(exc)
        await self.send(ErrorEvent(code=mapped.code, message=mapped.message, segment=segment))

    async def send(self, event: ServerEvent) -> None:
        async with self.send_lock:
            await self.ws.send_text(event.model_dump_json())


@router.websocket("/v1/audio/speech/ws")
async def speech_ws(ws: WebSocket) -> None:
    """Streaming text-to-speech for LLM agents; see :mod:`cosyserve.server.http.ws_protocol`."""
    await ws.accept()
    runtime: ServerRuntime = ws.app.state.runtime
    session = await _open(ws, runtime)
    if session is None:
        return
    try:
        await session.run()
    finally:
        if ws.application_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):  # the client may already be gone
                await ws.close(_CLOSE_NORMAL)


async def _open(ws: WebSocket, runtime: ServerRuntime) -> _Session | None:
    """Read and check the config message; on failure send an ``error`` event and close."""
    try:
        raw = await asyncio.wait_for(_receive_frame(ws), CONFIG_TIMEOUT_S)
        if raw is None:
            return None
        service = runtime.require_service()
        message = parse_client_message(raw)
        if not isinstance(message, ConfigMessage):
            raise InvalidMessageError("the first message must be a config message")
        # An unusable voice fails now, not once per sentence (off the event loop: the voice
        # store may be a database over the network).
        voice = await asyncio.to_thread(service.resolve_voice, message.voice)
        if message.instructions.strip() and not voice.has_audio_prompt:
            raise InvalidRequestError(
                "instructions need a voice made from prompt audio, not a built-in speaker"
            )
        encoder = create_encoder(message.format, service.sample_rate, message.sample_rate)
    except TimeoutError:
        await _refuse(ws, InvalidMessageError(f"no config message within {CONFIG_TIMEOUT_S:.0f} seconds"))
        return None
    except CosyserveError as exc:
        await _refuse(ws, exc)
        return None
    try:
        await ws.send_text(
            ReadyEvent(format=message.format, sample_rate=encoder.sample_rate).model_dump_json()
        )
    except Exception:  # the client is already gone
        encoder.close()
        return None
    return _Session(ws, service, message, encoder)


async def _refuse(ws: WebSocket, exc: CosyserveError) -> None:
    """Send the ``error`` event of a failed opening and close the connection."""
    mapped = map_error(exc)
    with contextlib.suppress(Exception):  # the client may already be gone
        await ws.send_text(ErrorEvent(code=mapped.code, message=mapped.message).model_dump_json())
        await ws.close(_CLOSE_POLICY)


async def _receive_frame(ws: WebSocket) -> str | bytes | None:
    """The next text or binary frame; None once the client has disconnected."""
    try:
        message = await ws.receive()
    except (WebSocketDisconnect, RuntimeError):  # RuntimeError: already disconnected
        return None
    if message["type"] == "websocket.disconnect":
        return None
    text: str | None = message.get("text")
    if text is not None:
        return text
    data: bytes = message.get("bytes") or b""
    return data


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
