"""What the gRPC servicers share: a synthesis streamed as encoded bytes, and errors
turned into gRPC statuses through the one error map."""

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, NoReturn

import grpc

from cosyserve.audio import AudioEncoder
from cosyserve.errors import InvalidRequestError
from cosyserve.server.error_map import map_error
from cosyserve.server.service import SpeechParams, SpeechService

# Trailing metadata of a failed call: the stable error code (cosyserve.errors), and for
# capacity errors the seconds to wait before retrying (as HTTP's Retry-After).
ERROR_CODE_KEY = "cosyserve-error-code"
RETRY_AFTER_KEY = "retry-after"

Context = grpc.aio.ServicerContext[Any, Any]


async def encoded_audio(
    service: SpeechService, params: SpeechParams, encoder: AudioEncoder
) -> AsyncGenerator[bytes, None]:
    """The bytes of ``encoder``'s stream as the service makes the audio (never empty pieces).

    Closing this generator early (the client cancelled) closes the synthesis, which aborts
    the request in the engine and releases its admission place; the encoder is closed
    either way.
    """
    synthesis = service.synthesize(params)
    with encoder:
        async with aclosing(synthesis) as chunks:
            async for chunk in chunks:
                data = encoder.encode(chunk.audio)
                if data:
                    yield data
        tail = encoder.finish()
        if tail:
            yield tail


def check_text(text: str, max_chars: int | None) -> None:
    if max_chars is not None and len(text) > max_chars:
        raise InvalidRequestError(f"text is longer than {max_chars} characters")


async def abort(context: Context, exc: BaseException, retry_after_s: int) -> NoReturn:
    """End the call with ``exc``'s status and its safe message (server-side failures get a
    generic message; :func:`map_error` logs them)."""
    mapped = map_error(exc, retry_after_s)
    metadata: list[tuple[str, str]] = [(ERROR_CODE_KEY, mapped.code)]
    if mapped.retry_after_s is not None:
        metadata.append((RETRY_AFTER_KEY, str(mapped.retry_after_s)))
    await context.abort(mapped.grpc_status, mapped.message, tuple(metadata))
