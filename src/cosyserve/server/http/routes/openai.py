"""OpenAI-compatible speech API: ``POST /v1/audio/speech`` and ``GET /v1/models``."""

from fastapi import APIRouter, Request, Response

from cosyserve.audio import create_encoder
from cosyserve.errors import InvalidRequestError
from cosyserve.pipeline.request import SynthesisOptions
from cosyserve.server.http.deps import runtime_of, service_of
from cosyserve.server.http.streaming import (
    CLIENT_CLOSED,
    SSE_MEDIA_TYPE,
    AudioStreamResponse,
    audio_response,
    sse_audio,
    start_stream,
    until_disconnected,
)
from cosyserve.server.http.wire import ModelCard, ModelList, SpeechRequest
from cosyserve.server.service import SpeechParams, SpeechService

router = APIRouter(tags=["openai"])

_AUDIO_RESPONSES: dict[int | str, dict[str, object]] = {
    200: {"content": {"audio/mpeg": {}, "audio/wav": {}, SSE_MEDIA_TYPE: {}}, "description": "Audio."},
}


@router.post("/v1/audio/speech", response_class=Response, responses=_AUDIO_RESPONSES)
async def create_speech(body: SpeechRequest, request: Request) -> Response:
    """Text to speech. Errors before the first audio byte have their own status (400, 404,
    429 with Retry-After, 503, 504); the whole file unless ``stream`` or ``stream_format``
    is ``sse``."""
    service = service_of(request, body.model)
    limit = runtime_of(request).settings.max_text_chars
    if len(body.input) > limit:
        raise InvalidRequestError(f"input is longer than {limit} characters")
    if body.instructions is not None and not body.instructions.strip():
        raise InvalidRequestError("instructions are empty")
    sse = body.stream_format == "sse"
    stream = body.stream or sse
    params = SpeechParams(
        text=body.input,
        voice=body.voice_name,
        instruct=body.instructions or "",
        stream=stream,
        options=SynthesisOptions(
            seed=body.seed,
            speed=body.speed,
            min_tokens=body.min_tokens,
            max_tokens=body.max_tokens,
            first_hop=body.first_hop,
        ),
    )
    # Building the encoder validates the format and rate before any synthesis work.
    encoder = create_encoder(body.response_format, service.sample_rate, body.sample_rate, stream=stream)
    if not sse:
        return await audio_response(request, service, params, encoder)
    try:
        started = await until_disconnected(request, start_stream(service.synthesize(params)))
    except BaseException:
        encoder.close()
        raise
    if started is None:
        encoder.close()
        return Response(status_code=CLIENT_CLOSED)
    usage = _usage_counter(service, body.input)
    return AudioStreamResponse(
        sse_audio(started, encoder, usage),
        media_type=SSE_MEDIA_TYPE,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    """The models this server runs, the default first. With one, the speech route accepts
    any ``model`` name; with several, ``model`` picks one by id (or family name)."""
    cards = []
    for path in runtime_of(request).settings.model_dir:
        try:
            created = int(path.stat().st_mtime)
        except OSError:
            created = 0
        cards.append(ModelCard(id=path.name, created=created))
    return ModelList(data=cards)


class _Usage:
    """The ``usage`` of ``speech.audio.done``: text tokens in, speech tokens (25 Hz) out."""

    def __init__(self, input_tokens: int, samples_per_token: int) -> None:
        self.input_tokens = input_tokens
        self.samples_per_token = samples_per_token

    def __call__(self, samples: int) -> dict[str, int]:
        output = -(-samples // self.samples_per_token)
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": output,
            "total_tokens": self.input_tokens + output,
        }


def _usage_counter(service: SpeechService, text: str) -> _Usage:
    hp = service.model.hparams
    return _Usage(len(service.model.tokenizer.encode(text)), hp.sample_rate // hp.flow.input_frame_rate)
