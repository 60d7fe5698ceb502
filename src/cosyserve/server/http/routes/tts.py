"""``GET /tts?text=...&voice=...``: a WAV for a link, a browser's ``<audio src>`` or curl."""

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from cosyserve.audio import create_encoder
from cosyserve.errors import InvalidRequestError
from cosyserve.pipeline.request import SynthesisOptions
from cosyserve.server.http.deps import runtime_of, service_of
from cosyserve.server.http.streaming import audio_response
from cosyserve.server.http.wire import MAX_FORCED_TOKENS
from cosyserve.server.service import SpeechParams

router = APIRouter(tags=["tts"])


@router.get("/tts", response_class=Response, responses={200: {"content": {"audio/wav": {}}}})
async def tts(
    request: Request,
    text: Annotated[str, Query(min_length=1, description="Text to speak.")],
    voice: Annotated[
        str | None,
        Query(min_length=1, max_length=64, description="Voice name (default: the server's default_voice)."),
    ] = None,
    stream: Annotated[bool, Query(description="Send audio as it is made (open-ended WAV).")] = False,
    seed: Annotated[int | None, Query(ge=0, lt=2**63)] = None,
    min_tokens: Annotated[int | None, Query(ge=1, le=MAX_FORCED_TOKENS)] = None,
    max_tokens: Annotated[int | None, Query(ge=1, le=MAX_FORCED_TOKENS)] = None,
    model: Annotated[
        str | None,
        Query(
            min_length=1, max_length=256, description="Model id or family name (default: the first served)."
        ),
    ] = None,
) -> Response:
    """16-bit mono WAV at 24 kHz: a whole file with exact sizes, or streamed with ``stream``."""
    service = service_of(request, model)
    limit = runtime_of(request).settings.max_text_chars
    if len(text) > limit:
        raise InvalidRequestError(f"text is longer than {limit} characters")
    params = SpeechParams(
        text=text,
        voice=voice,
        stream=stream,
        options=SynthesisOptions(seed=seed, min_tokens=min_tokens, max_tokens=max_tokens),
    )
    encoder = create_encoder("wav", service.sample_rate, stream=stream)
    return await audio_response(request, service, params, encoder)
