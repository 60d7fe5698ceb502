"""Upstream CosyVoice's FastAPI endpoints (``runtime/python/fastapi/server.py``), so that
its ``client.py`` and tools written against it work unchanged.

Each endpoint answers GET and POST with form fields (multipart when a ``prompt_wav`` file
is uploaded, url-encoded otherwise; upstream's client sends a form body even with GET),
and streams raw little-endian int16 mono PCM at the model's rate (24 kHz for CosyVoice 2)
as the audio is made. Fields may also come in the query string. Differences from upstream:

* audio streams chunk by chunk instead of sentence by sentence, and is clipped rather
  than wrapped at full scale (:mod:`cosyserve.audio.pcm`);
* ``prompt_wav`` may be any format the server decodes, at any rate;
* the prompt endpoints also accept ``spk_id`` (a registered voice) instead of ``prompt_wav``;
* an optional ``seed`` field (a non-negative integer) makes the audio reproducible;
* ``/inference_instruct`` (CosyVoice 1 only) answers 400, pointing to ``/inference_instruct2``.

Errors found before the first audio (bad fields, an unknown voice, undecodable prompt
audio, overload) are JSON error responses with a 4xx/5xx status; a failure after audio
has started can only end the stream early.
"""

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.datastructures import FormData

from cosyserve.audio import create_encoder
from cosyserve.errors import InvalidRequestError
from cosyserve.pipeline.request import Mode, SynthesisOptions
from cosyserve.server.http.deps import runtime_of, service_of
from cosyserve.server.http.forms import read_form, read_upload, text_field
from cosyserve.server.http.streaming import audio_response
from cosyserve.server.service import SpeechParams

router = APIRouter(tags=["upstream CosyVoice"])

_METHODS = ["GET", "POST"]
# Upstream's voice and instruction fields are short; the limit keeps junk out of memory.
_MAX_FIELD_CHARS = 1000
_MAX_SEED = 2**63


async def _speech(request: Request, mode: Mode) -> Response:
    service = service_of(request)
    form = await read_form(request)
    try:
        params = await _params(request, form, mode)
    finally:
        await form.close()
    encoder = create_encoder("pcm", service.sample_rate)
    return await audio_response(request, service, params, encoder)


async def _params(request: Request, form: FormData, mode: Mode) -> SpeechParams:
    def field(name: str, max_chars: int = _MAX_FIELD_CHARS) -> str:
        return text_field(form, request, name, max_chars)

    text = field("tts_text", runtime_of(request).settings.max_text_chars)
    if not text.strip():
        raise InvalidRequestError("tts_text is required")
    voice = field("spk_id").strip() or None
    options = SynthesisOptions(seed=_seed(field("seed")))
    if mode is Mode.SFT:
        if voice is None:
            raise InvalidRequestError("spk_id is required")
        return SpeechParams(text=text, voice=voice, mode=mode, options=options)
    audio = await read_upload(form, "prompt_wav")
    if audio is None and voice is None:
        raise InvalidRequestError("prompt_wav is required (a file upload)")
    instruct = field("instruct_text") if mode is Mode.INSTRUCT2 else ""
    if mode is Mode.INSTRUCT2 and not instruct.strip():
        raise InvalidRequestError("instruct_text is required")
    prompt_text = field("prompt_text") if mode is Mode.ZERO_SHOT else ""
    if mode is Mode.ZERO_SHOT and audio is not None and not prompt_text.strip():
        raise InvalidRequestError("prompt_text is required (the transcript of prompt_wav)")
    return SpeechParams(
        text=text,
        voice=None if audio is not None else voice,
        prompt_audio=audio,
        prompt_text=prompt_text,
        instruct=instruct,
        mode=mode,
        options=options,
    )


def _seed(value: str) -> int | None:
    value = value.strip()
    if not value:
        return None
    if not value.isascii() or not value.isdigit() or int(value) >= _MAX_SEED:
        raise InvalidRequestError(f"seed must be an integer from 0 to {_MAX_SEED - 1}")
    return int(value)


@router.api_route(
    "/inference_sft", methods=_METHODS, summary="Synthesize with a built-in or registered voice"
)
async def inference_sft(request: Request) -> Response:
    """Form fields ``tts_text``, ``spk_id``."""
    return await _speech(request, Mode.SFT)


@router.api_route("/inference_zero_shot", methods=_METHODS, summary="Clone a voice from a prompt recording")
async def inference_zero_shot(request: Request) -> Response:
    """Form fields ``tts_text``, ``prompt_text``, file ``prompt_wav``."""
    return await _speech(request, Mode.ZERO_SHOT)


@router.api_route("/inference_cross_lingual", methods=_METHODS, summary="Clone a voice across languages")
async def inference_cross_lingual(request: Request) -> Response:
    """Form fields ``tts_text``, file ``prompt_wav``."""
    return await _speech(request, Mode.CROSS_LINGUAL)


@router.api_route("/inference_instruct2", methods=_METHODS, summary="Cloned voice with a style instruction")
async def inference_instruct2(request: Request) -> Response:
    """Form fields ``tts_text``, ``instruct_text``, file ``prompt_wav``."""
    return await _speech(request, Mode.INSTRUCT2)


@router.api_route(
    "/inference_instruct", methods=_METHODS, summary="CosyVoice 1 only: use /inference_instruct2"
)
async def inference_instruct(request: Request) -> Response:
    raise InvalidRequestError(
        "/inference_instruct is CosyVoice 1 only; CosyVoice 2 uses /inference_instruct2 "
        "(tts_text, instruct_text, prompt_wav)"
    )
