"""Voice registration: ``/v1/audio/voices``.

A registered voice's prompt features (speech tokens, mel, speaker embedding, transcript
ids) are computed once, at registration, and stored (once for each model family served:
CosyVoice 2 and 3 have their own speech tokenizers); afterwards ``voice=<name>`` works,
with every model served, in every mode of ``/v1/audio/speech`` (zero_shot when the voice has a transcript,
cross_lingual, instruct2 with ``instructions``), in ``/inference_sft`` and the WebSocket.
"""

import asyncio
from typing import Literal

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from cosyserve.errors import InvalidRequestError
from cosyserve.pipeline.voice import VoicePrompt, check_voice_name
from cosyserve.server.http.deps import service_of
from cosyserve.server.http.forms import read_form, read_upload, text_field
from cosyserve.server.service import SpeechService, VoiceRegistry
from cosyserve.voices import VoiceStore

router = APIRouter(prefix="/v1/audio/voices", tags=["voices"])

_MAX_TRANSCRIPT_CHARS = 1000


class VoiceEntry(BaseModel):
    """One voice. ``kind``: ``registered`` (uploaded) or ``builtin`` (``spk2info.pt``).
    ``modes``: the synthesis modes it supports. ``created_at`` (Unix seconds) and
    ``sha256`` (of the uploaded recording) are set for registered voices."""

    name: str
    kind: Literal["registered", "builtin"]
    modes: list[str]
    created_at: int | None = None
    sha256: str | None = None


class VoiceList(BaseModel):
    voices: list[VoiceEntry]


def _registered(voice_name: str, has_transcript: bool, created_at: float | None, sha256: str) -> VoiceEntry:
    modes = ["zero_shot"] if has_transcript else []
    return VoiceEntry(
        name=voice_name,
        kind="registered",
        modes=[*modes, "cross_lingual", "instruct2", "sft"],
        created_at=None if created_at is None else int(created_at),
        sha256=sha256 or None,
    )


def _builtin(voice_name: str) -> VoiceEntry:
    return VoiceEntry(name=voice_name, kind="builtin", modes=["sft"])


def _registered_in(registry: VoiceRegistry) -> list[VoiceEntry]:
    if isinstance(registry, VoiceStore):
        return [
            _registered(i.name, bool(i.prompt_text), i.created_at, i.audio_sha256)
            for i in registry.list_info()
        ]
    registered = []  # another registry (tests, embedding): no creation times
    for name in registry.names():
        voice = registry.get(name)
        if voice is not None:
            registered.append(_registered(name, bool(voice.prompt_text_ids), None, voice.audio_sha256))
    return registered


def _entries(service: SpeechService) -> list[VoiceEntry]:
    """Registered voices (each once, though each model family served keeps its own
    features), then the built-in speakers of every model served."""
    registered: dict[str, VoiceEntry] = {}
    for registry in service.voice_registries():
        for entry in _registered_in(registry):
            registered.setdefault(entry.name, entry)
    return [registered[name] for name in sorted(registered)] + [
        _builtin(name) for name in service.builtin_names()
    ]


@router.get("", summary="List registered and built-in voices")
async def list_voices(request: Request) -> VoiceList:
    # The voice store is called off the event loop (here and below): a database over the
    # network may take seconds, and other requests' streams must not wait for it.
    return VoiceList(voices=await asyncio.to_thread(_entries, service_of(request)))


@router.post("", status_code=201, summary="Register a voice from a reference recording")
async def add_voice(request: Request) -> VoiceEntry:
    """Multipart form: ``name``, file ``audio`` (the reference recording, 0.5-30 s, any
    common format) and optional ``transcript`` (what it says; without one the voice
    cannot be used for zero_shot, only cross_lingual/instruct2/sft)."""
    service = service_of(request)
    form = await read_form(request)
    try:
        name = text_field(form, request, "name", 64).strip()
        if not name:
            raise InvalidRequestError("name is required")
        check_voice_name(name)
        transcript = text_field(form, request, "transcript", _MAX_TRANSCRIPT_CHARS)
        audio = await read_upload(form, "audio")
    finally:
        await form.close()
    if audio is None:
        raise InvalidRequestError("audio is required (a file upload of the reference recording)")
    voice: VoicePrompt = await service.add_voice(name, audio, transcript)
    registry = service.voices
    info = await asyncio.to_thread(registry.info, name) if isinstance(registry, VoiceStore) else None
    return _registered(
        name, bool(voice.prompt_text_ids), info.created_at if info else None, voice.audio_sha256
    )


@router.delete("/{name}", status_code=204, summary="Delete a registered voice")
async def delete_voice(name: str, request: Request) -> Response:
    service = service_of(request)
    check_voice_name(name)
    if service.is_builtin(name):
        raise InvalidRequestError(f"voice {name!r} is built in and cannot be deleted")
    await asyncio.to_thread(service.delete_voice, name)
    return Response(status_code=204)
