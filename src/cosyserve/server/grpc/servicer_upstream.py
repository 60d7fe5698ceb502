"""Upstream CosyVoice's gRPC service (``cosyvoice.CosyVoice/Inference``), wire-compatible
with its ``runtime/python/grpc/client.py``.

Requests: ``prompt_audio`` is raw 16-bit PCM at 16 kHz, as upstream's client sends it.
Responses: raw little-endian int16 mono PCM at the model's rate (24 kHz), one message per
chunk as the audio is made (token-level streaming; upstream sends whole sentences). The
samples are clipped rather than wrapped around as upstream's ``tts_speech * 2**15`` does.

The proto carries no synthesis options, so every request gets the server's
:attr:`GrpcConfig.upstream_options` (default: upstream's behaviour, a fresh seed each).
"""

import io
import logging
import wave
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from cosyserve.audio import create_encoder
from cosyserve.errors import InvalidRequestError, PromptAudioError
from cosyserve.pipeline.request import Mode
from cosyserve.server.grpc.config import GrpcConfig
from cosyserve.server.grpc.protos import cosyvoice_pb2 as pb
from cosyserve.server.grpc.protos import cosyvoice_pb2_grpc
from cosyserve.server.grpc.rpc import ERROR_CODE_KEY, Context, abort, check_text, encoded_audio
from cosyserve.server.service import SpeechParams, SpeechService

logger = logging.getLogger(__name__)

PROMPT_SAMPLE_RATE = 16000
_INSTRUCT_V1 = (
    "instruct_request is CosyVoice 1's instruct mode (a built-in speaker plus an instruction),"
    " which CosyVoice 2 does not have; use cosyserve.v1.Speech/Synthesize with instruct and a voice"
)


class UpstreamServicer(cosyvoice_pb2_grpc.CosyVoiceServicer):
    """``sft_request.spk_id`` names a built-in speaker or a registered voice; a registered
    voice synthesises with its whole prompt (zero-shot, or cross-lingual without a
    transcript), which is what registering it is for."""

    def __init__(self, service: SpeechService, config: GrpcConfig) -> None:
        self._service = service
        self._options = config.upstream_options
        self._max_text_chars = config.max_text_chars

    async def Inference(self, request: pb.Request, context: Context) -> AsyncIterator[pb.Response]:
        if request.WhichOneof("RequestPayload") == "instruct_request":
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, _INSTRUCT_V1, ((ERROR_CODE_KEY, "unimplemented"),)
            )
        try:
            params = self._params(request)
            check_text(params.text, self._max_text_chars)
            encoder = create_encoder("pcm", self._service.sample_rate)
            async with aclosing(encoded_audio(self._service, params, encoder)) as pieces:
                async for data in pieces:
                    yield pb.Response(tts_audio=data)
            return
        except Exception as exc:  # every failure becomes a status; nothing internal leaks
            error = exc
        await abort(context, error, self._service.limits.retry_after_s)

    def _params(self, request: pb.Request) -> SpeechParams:
        payload = request.WhichOneof("RequestPayload")
        if payload == "sft_request":
            sft = request.sft_request
            return SpeechParams(text=sft.tts_text, voice=sft.spk_id, options=self._options)
        if payload == "zero_shot_request":
            zero_shot = request.zero_shot_request
            return SpeechParams(
                text=zero_shot.tts_text,
                prompt_audio=wav_from_pcm16(zero_shot.prompt_audio),
                prompt_text=zero_shot.prompt_text,
                mode=Mode.ZERO_SHOT,
                options=self._options,
            )
        if payload == "cross_lingual_request":
            cross = request.cross_lingual_request
            return SpeechParams(
                text=cross.tts_text,
                prompt_audio=wav_from_pcm16(cross.prompt_audio),
                mode=Mode.CROSS_LINGUAL,
                options=self._options,
            )
        raise InvalidRequestError(
            "the request has no payload: set sft_request, zero_shot_request or cross_lingual_request"
        )


def wav_from_pcm16(pcm: bytes, sample_rate: int = PROMPT_SAMPLE_RATE) -> bytes:
    """Raw little-endian int16 mono samples wrapped in a WAV file (what the service decodes)."""
    if not pcm:
        raise PromptAudioError("prompt_audio is empty")
    if len(pcm) % 2:
        raise PromptAudioError("prompt_audio must be 16-bit PCM samples (an even number of bytes)")
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm)
    return out.getvalue()
