"""cosyserve's own gRPC service, ``cosyserve.v1.Speech``: synthesis with every mode, voice
and output option, and the voice registry."""

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from google.protobuf.timestamp_pb2 import Timestamp

from cosyserve.audio import AudioEncoder, create_encoder
from cosyserve.errors import InvalidRequestError
from cosyserve.pipeline.request import Mode, SynthesisOptions
from cosyserve.server.grpc.config import GrpcConfig
from cosyserve.server.grpc.protos import cosyserve_v1_pb2 as pb
from cosyserve.server.grpc.protos import cosyserve_v1_pb2_grpc
from cosyserve.server.grpc.rpc import Context, abort, check_text, encoded_audio
from cosyserve.server.service import SpeechParams, SpeechService
from cosyserve.voices import VoiceInfo, VoiceStore

logger = logging.getLogger(__name__)

_MODES: dict[int, Mode | None] = {
    pb.MODE_UNSPECIFIED: None,
    pb.MODE_ZERO_SHOT: Mode.ZERO_SHOT,
    pb.MODE_CROSS_LINGUAL: Mode.CROSS_LINGUAL,
    pb.MODE_INSTRUCT2: Mode.INSTRUCT2,
    pb.MODE_SFT: Mode.SFT,
    pb.MODE_VC: Mode.VC,
}
_KINDS = {"registered": pb.VOICE_KIND_REGISTERED, "builtin": pb.VOICE_KIND_BUILTIN}


class SpeechServicer(cosyserve_v1_pb2_grpc.SpeechServicer):
    def __init__(self, service: SpeechService, config: GrpcConfig) -> None:
        self._service = service
        self._max_text_chars = config.max_text_chars

    async def Synthesize(
        self, request: pb.SynthesizeRequest, context: Context
    ) -> AsyncIterator[pb.SynthesizeResponse]:
        try:
            params = self._params(request)
            # Built before admission: an unsupported format or rate is refused at once.
            encoder = create_encoder(
                request.format or "pcm",
                self._service.sample_rate,
                request.sample_rate if request.HasField("sample_rate") else None,
                stream=params.stream,
            )
            sent = False
            async with aclosing(encoded_audio(self._service, params, encoder)) as pieces:
                async for data in pieces:
                    yield self._response(data, None if sent else encoder)
                    sent = True
            if not sent:  # no audio at all: still say what the (empty) stream is
                yield self._response(b"", encoder)
            return
        except Exception as exc:  # every failure becomes a status; nothing internal leaks
            error = exc
        await abort(context, error, self._service.limits.retry_after_s)

    async def ListVoices(self, request: pb.ListVoicesRequest, context: Context) -> pb.ListVoicesResponse:
        try:
            # The voice store is called off the event loop (here and below): a database over
            # the network may take seconds, and other calls' streams must not wait for it.
            return await asyncio.to_thread(self._list_voices)
        except Exception as exc:
            error = exc
        await abort(context, error, self._service.limits.retry_after_s)

    async def AddVoice(self, request: pb.AddVoiceRequest, context: Context) -> pb.Voice:
        try:
            if not request.audio:
                raise InvalidRequestError("audio is required: a recording of the voice")
            await self._service.add_voice(request.name, request.audio, request.prompt_text)
            store = self._store()
            info = await asyncio.to_thread(store.info, request.name) if store else None
            return _voice(request.name, "registered", info)
        except Exception as exc:
            error = exc
        await abort(context, error, self._service.limits.retry_after_s)

    async def DeleteVoice(self, request: pb.DeleteVoiceRequest, context: Context) -> pb.DeleteVoiceResponse:
        try:
            await asyncio.to_thread(self._service.delete_voice, request.name)
            return pb.DeleteVoiceResponse()
        except Exception as exc:
            error = exc
        await abort(context, error, self._service.limits.retry_after_s)

    def _params(self, request: pb.SynthesizeRequest) -> SpeechParams:
        check_text(request.text, self._max_text_chars)
        if request.voice and request.prompt_audio:
            raise InvalidRequestError("give either voice or prompt_audio, not both")
        if request.mode not in _MODES:
            raise InvalidRequestError("unknown mode")
        options = SynthesisOptions(
            seed=request.seed if request.HasField("seed") else None,
            speed=request.speed if request.HasField("speed") else 1.0,
            min_tokens=request.min_tokens if request.HasField("min_tokens") else None,
            max_tokens=request.max_tokens if request.HasField("max_tokens") else None,
            first_hop=request.first_hop if request.HasField("first_hop") else None,
        )
        return SpeechParams(
            text=request.text,
            voice=request.voice or None,
            prompt_audio=request.prompt_audio or None,
            prompt_text=request.prompt_text,
            instruct=request.instruct,
            source_audio=request.source_audio or None,
            mode=_MODES[request.mode],
            stream=request.stream if request.HasField("stream") else True,
            options=options,
        )

    def _list_voices(self) -> pb.ListVoicesResponse:
        infos = {info.name: info for info in self._voice_infos()}
        voices = [_voice(name, kind, infos.get(name)) for name, kind in self._service.voice_names()]
        return pb.ListVoicesResponse(voices=voices)

    def _store(self) -> VoiceStore | None:
        voices = self._service.voices
        return voices if isinstance(voices, VoiceStore) else None

    def _voice_infos(self) -> list[VoiceInfo]:
        """Every family's registered voices, each name once (the default model's first)."""
        infos: dict[str, VoiceInfo] = {}
        for registry in self._service.voice_registries():
            if isinstance(registry, VoiceStore):
                for info in registry.list_info():
                    infos.setdefault(info.name, info)
        return list(infos.values())

    @staticmethod
    def _response(data: bytes, encoder: AudioEncoder | None) -> pb.SynthesizeResponse:
        response = pb.SynthesizeResponse(audio=data)
        if encoder is not None:
            response.content_type = encoder.content_type
            response.sample_rate = encoder.sample_rate
        return response


def _voice(name: str, kind: str, info: VoiceInfo | None) -> pb.Voice:
    voice = pb.Voice(name=name, kind=_KINDS[kind])
    if info is not None:
        created = Timestamp()
        created.FromNanoseconds(round(info.created_at * 1e9))
        voice.prompt_text = info.prompt_text
        voice.audio_sha256 = info.audio_sha256
        voice.created_at.CopyFrom(created)
    return voice
