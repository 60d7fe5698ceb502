"""Turning the service's audio chunks into HTTP response bodies, shared by the routes.

A streamed response waits for the request's first audio chunk before it sends headers,
so admission, voice and validation errors (429, 404, 400, ...) still get their status
code; after that, audio bytes go out as they are made. Whatever ends a stream (the last
chunk, an error, a client that disconnects, server shutdown), the synthesis generator and
the encoder are closed, which aborts the request in the engine and frees its place.
"""

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from cosyserve.audio import AudioEncoder
from cosyserve.engine.async_engine import AudioChunk
from cosyserve.errors import CosyserveError
from cosyserve.server.error_map import map_error
from cosyserve.server.service import SpeechParams, SpeechService

logger = logging.getLogger(__name__)

SSE_MEDIA_TYPE = "text/event-stream"
# nginx's status for "client closed the request"; nobody receives it, the access log does.
CLIENT_CLOSED = 499

_T = TypeVar("_T")


class StartedStream:
    """A synthesis whose first chunk has arrived: ``first`` (None if it made no audio)
    and the generator of the rest. Close it with :meth:`aclose` if it is never consumed."""

    def __init__(self, first: AudioChunk | None, rest: AsyncIterator[AudioChunk]) -> None:
        self.first = first
        self.rest = rest

    async def chunks(self) -> AsyncIterator[AudioChunk]:
        if self.first is not None:
            yield self.first
        async for chunk in self.rest:
            yield chunk

    async def aclose(self) -> None:
        aclose = getattr(self.rest, "aclose", None)
        if aclose is not None:
            await aclose()


async def start_stream(chunks: AsyncIterator[AudioChunk]) -> StartedStream:
    """Run ``chunks`` up to its first chunk; errors up to then propagate to the caller."""
    try:
        first = await anext(chunks, None)
    except BaseException:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
        raise
    return StartedStream(first, chunks)


async def encode_whole(chunks: AsyncIterator[AudioChunk], encoder: AudioEncoder) -> bytes:
    """The complete file (a whole-response encoder gives everything from ``finish``)."""
    try:
        parts = [encoder.encode(chunk.audio) async for chunk in chunks]
        return b"".join(parts) + encoder.finish()
    finally:
        encoder.close()
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


async def encoded_audio(stream: StartedStream, encoder: AudioEncoder) -> AsyncIterator[bytes]:
    """The bytes of a streamed audio response, sent as the encoder produces them."""
    try:
        async for chunk in stream.chunks():
            data = encoder.encode(chunk.audio)
            if data:
                yield data
        yield encoder.finish()
    finally:
        encoder.close()
        await stream.aclose()


async def sse_audio(
    stream: StartedStream, encoder: AudioEncoder, usage: Callable[[int], dict[str, int]]
) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's speech streaming shape: ``speech.audio.delta`` events
    carrying base64 audio in the response format, then ``speech.audio.done`` with
    ``usage(samples)``. An error after the first event becomes an ``error`` event."""
    samples = 0
    try:
        try:
            async for chunk in stream.chunks():
                samples += chunk.audio.size
                data = encoder.encode(chunk.audio)
                if data:
                    yield _sse_delta(data)
            tail = encoder.finish()
            if tail:
                yield _sse_delta(tail)
        except CosyserveError as exc:
            yield _sse_event({"type": "error", **map_error(exc).openai_body()})
            return
        yield _sse_event({"type": "speech.audio.done", "usage": usage(samples)})
    finally:
        encoder.close()
        await stream.aclose()


def _sse_delta(data: bytes) -> bytes:
    return _sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})


def _sse_event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class AudioStreamResponse(StreamingResponse):
    """A streaming response that always closes its body generator, at once.

    Starlette stops iterating when the client disconnects but leaves the generator to the
    garbage collector; closing it here aborts the engine request deterministically. An
    error after the headers went out cannot change the status any more: the connection is
    closed without the final chunk, so the client sees a truncated (failed) transfer.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except CosyserveError as exc:
            mapped = map_error(exc)
            logger.warning("stream ended early: %s: %s", mapped.code, mapped.message)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def audio_response(
    request: Request, service: SpeechService, params: SpeechParams, encoder: AudioEncoder
) -> Response:
    """Synthesise ``params`` into a response: the whole file (``params.stream`` False) or
    audio bytes as they are made. Takes ownership of ``encoder``."""
    try:
        if not params.stream:
            audio = await until_disconnected(request, encode_whole(service.synthesize(params), encoder))
            if audio is None:
                return Response(status_code=CLIENT_CLOSED)
            return Response(audio, media_type=encoder.content_type)
        started = await until_disconnected(request, start_stream(service.synthesize(params)))
    except BaseException:
        encoder.close()
        raise
    if started is None:
        encoder.close()
        return Response(status_code=CLIENT_CLOSED)
    return AudioStreamResponse(encoded_audio(started, encoder), media_type=encoder.content_type)


async def until_disconnected(request: Request, work: Coroutine[Any, Any, _T]) -> _T | None:
    """Run ``work`` unless the client disconnects first; then cancel it and return None.

    For whatever runs before the response starts (a whole file's synthesis, a stream's
    wait in the queue): the server notices a disconnect only when it next sends, so
    without this a client that gave up would keep its place until its audio is made.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Let the cancellation run the synthesis cleanup (engine abort) before going on.
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        logger.info("client disconnected; request cancelled")
        return None
    return task.result()


async def _disconnect(request: Request) -> None:
    # The body has been read, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
