"""The speech service: what every transport (HTTP, WebSocket, gRPC) calls.

It resolves voices, infers the mode, runs the frontend off the event loop, admits or
refuses requests (bounded concurrency and queue: overload is refused at once, never left
to hang), enforces the per-request deadline, and streams the engine's audio. It imports
no web or RPC library; transports map its :class:`~cosyserve.errors.CosyserveError`
subclasses to status codes in :mod:`cosyserve.server.error_map`.
"""

import asyncio
import contextlib
import contextvars
import dataclasses
import hashlib
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol, TypeVar

from cosyserve.engine.async_engine import AsyncEngine, AudioChunk
from cosyserve.engine.loader import LoadedModel
from cosyserve.engine.request import GenerationSpec
from cosyserve.errors import CosyserveError, InvalidRequestError
from cosyserve.logging_setup import current_request_id
from cosyserve.parallelism import pin_torch_threads
from cosyserve.pipeline.frontend import Frontend, UnknownSpeakerError
from cosyserve.pipeline.request import Mode, SynthesisOptions, SynthesisRequest
from cosyserve.pipeline.voice import (
    VOICE_ALIASES,
    VOICE_NAME,
    VoiceExistsError,
    VoicePrompt,
    check_voice_name,
)
from cosyserve.server.audio_cache import AudioCache
from cosyserve.server.http.request_context import current_record

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
# Voice names become URL path segments and database keys: no separators, no dots.


class DeadlineExceededError(CosyserveError):
    """The request ran past its deadline and was aborted."""

    code = "deadline_exceeded"


@dataclass(frozen=True)
class ServiceLimits:
    """``deadline_s`` bounds a request's whole life (None: no deadline); a refused request
    (the engine's admission gate is full) is told to retry after ``retry_after_s``."""

    deadline_s: float | None = 300.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.deadline_s is not None and self.deadline_s <= 0:
            raise ValueError("deadline_s must be positive")


class VoiceRegistry(Protocol):
    """Where registered voices live (a :class:`~cosyserve.voices.VoiceStore` in production)."""

    def get(self, name: str) -> VoicePrompt | None: ...

    def put(self, voice: VoicePrompt) -> None: ...

    def delete(self, name: str) -> bool: ...

    def names(self) -> list[str]: ...


@dataclass(frozen=True, eq=False)
class SpeechParams:
    """A transport-neutral synthesis request.

    The voice is ``prompt_audio`` (a recording, any supported format; with
    ``prompt_text`` its transcript) or ``voice`` (a registered voice or a built-in
    speaker). ``mode`` None infers it: source audio -> vc, an instruction -> instruct2,
    a voice with a transcript -> zero_shot, with audio only -> cross_lingual, a built-in
    embedding-only speaker -> sft.
    """

    text: str
    voice: str | None = None
    prompt_audio: bytes | None = None
    prompt_text: str = ""
    instruct: str = ""
    source_audio: bytes | None = None
    mode: Mode | None = None
    stream: bool = True
    options: SynthesisOptions = field(default_factory=SynthesisOptions)


class SpeechService:
    """One per served model; shared by all transports through the app's runtime.

    A process serving several models has one service each; :attr:`peers` are the others.
    Registered voices are per model family (their prompt features come from the family's
    own speech tokenizer), so registering a voice through any service computes and stores
    it for every family served; listing shows each name once; deleting deletes it for all.
    """

    def __init__(
        self,
        model: LoadedModel,
        engine: AsyncEngine,
        voices: VoiceRegistry,
        limits: ServiceLimits | None = None,
        frontend_threads: int = 2,
        default_voice: str = "",
    ) -> None:
        """``default_voice``: the voice of requests that name none ("": the first built-in
        speaker)."""
        self.model = model
        # The model's id in requests (``model``): its directory's name; the runtime sets it.
        self.model_id = model.model_dir.root.name
        # The services of the other models this process serves (set by the runtime).
        self.peers: tuple[SpeechService, ...] = ()
        self.default_voice = default_voice
        self.engine = engine
        self.voices = voices
        self.limits = limits or ServiceLimits()
        self.frontend = Frontend(model)
        # Set by the app when the audio cache is configured (see server/preflight.py).
        self.audio_cache: AudioCache | None = None
        # One torch thread each: only the engine's thread keeps an OpenMP pool (cosyserve.parallelism).
        self._executor = ThreadPoolExecutor(
            frontend_threads,
            thread_name_prefix="cosyserve-frontend",
            initializer=pin_torch_threads,
            initargs=(1,),
        )

    @property
    def sample_rate(self) -> int:
        return self.model.hparams.sample_rate

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished (synthesising or queued)."""
        return self.engine.admission.held

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    # -- synthesis --------------------------------------------------------------------------

    async def synthesize(self, params: SpeechParams) -> AsyncGenerator[AudioChunk, None]:
        """:meth:`_synthesize`, noting voice, text and audio in the HTTP request's record
        (its summary log line and metrics)."""
        record = current_record()
        if record is None:
            async for chunk in self._synthesize(params):
                yield chunk
            return
        record.voice = params.voice or ("prompt_audio" if params.prompt_audio is not None else None)
        record.model = self.model_id
        record.text = params.text
        record.characters = len(params.text)
        try:
            async for chunk in self._synthesize(params):
                record.add_audio(chunk.audio.size, self.sample_rate)
                yield chunk
        except CosyserveError as exc:
            record.error = exc.code
            raise

    async def _synthesize(self, params: SpeechParams) -> AsyncGenerator[AudioChunk, None]:
        """Admit, prepare and stream one request's audio (float32 mono at
        :attr:`sample_rate`). Stopping the iteration early aborts the request.

        A non-streaming request with a seed is answered from :attr:`audio_cache` when it
        holds the same request, and stored there once its synthesis completes."""
        with self.engine.admission.place():
            cache = self.audio_cache if not params.stream and params.options.seed is not None else None
            key = None if cache is None else await self._run(self._cache_key, cache, params)
            if cache is not None and key is not None:
                cached = await self._run(cache.get, key)
                if cached is not None:
                    for chunk in cached:
                        yield chunk
                    return
            made: list[AudioChunk] = []
            loop = asyncio.get_running_loop()
            deadline = None if self.limits.deadline_s is None else loop.time() + self.limits.deadline_s
            request = await self._run(self._request, params)
            spec = await self.build_spec(request, uuid.uuid4().hex)
            spec = replace(spec, log_id=current_request_id())  # engine log lines carry the request id
            chunks = self.engine.generate(spec, admitted=True)
            try:
                while True:
                    remaining = None if deadline is None else deadline - loop.time()
                    if remaining is not None and remaining <= 0:
                        raise DeadlineExceededError("the request ran past its deadline")
                    try:
                        chunk = await asyncio.wait_for(anext(chunks), remaining)
                    except StopAsyncIteration:
                        if cache is not None and key is not None:
                            await self._run(cache.put, key, made)
                        return
                    except TimeoutError:
                        raise DeadlineExceededError("the request ran past its deadline") from None
                    if key is not None:
                        made.append(chunk)
                    yield chunk
            finally:
                await chunks.aclose()  # aborts the engine request if it is still running

    def _request(self, params: SpeechParams) -> SynthesisRequest:
        """Resolve the voice and mode (runs on the frontend pool: feature extraction is CPU work)."""
        if params.prompt_audio is not None:
            voice = self.frontend.voice_from_audio(params.prompt_audio, params.prompt_text)
        else:
            voice = self.resolve_voice(params.voice or self._default_voice_name())
        source = self.frontend.source_tokens(params.source_audio) if params.source_audio else None
        mode = params.mode or _infer_mode(params, voice)
        return SynthesisRequest(
            text=params.text,
            mode=mode,
            voice=voice,
            instruct=params.instruct,
            source_speech_tokens=source,
            stream=params.stream,
            options=params.options,
        )

    def _cache_key(self, cache: AudioCache, params: SpeechParams) -> str | None:
        """The cache key of ``params``, or None for a voice that does not resolve (the
        synthesis path reports that). Voices are keyed by content: a registered voice
        deleted and registered again under its name with other audio gets a new key."""
        voice: dict[str, str]
        if params.prompt_audio is not None:
            voice = {"audio": hashlib.sha256(params.prompt_audio).hexdigest(), "text": params.prompt_text}
        elif params.voice in self.model.speakers:  # first, as resolve_voice: no store lookup
            voice = {"builtin": params.voice}
        elif params.voice and VOICE_NAME.fullmatch(params.voice):
            registered = self.voices.get(params.voice)
            if registered is None:
                return None
            voice = {"registered": hashlib.sha256(registered.to_bytes()).hexdigest()}
        else:
            return None
        source = None if params.source_audio is None else hashlib.sha256(params.source_audio).hexdigest()
        return cache.key(
            {
                "model": self.model_id,
                "text": params.text,
                "voice": voice,
                "instruct": params.instruct,
                "source": source,
                "mode": None if params.mode is None else params.mode.value,
                "options": dataclasses.asdict(params.options),
            }
        )

    # -- voices -----------------------------------------------------------------------------

    def resolve_voice(self, name: str) -> VoicePrompt:
        """A registered voice, else a built-in speaker (by name or alias, e.g. ``zh_female``);
        :class:`UnknownSpeakerError` if neither."""
        check_voice_name(name)
        # A built-in name cannot be registered (add_voice), so it needs no store lookup: the
        # built-ins keep working while a shared voice database is down.
        if name in self.model.speakers:
            return self.frontend.speaker(name)
        voice = self.voices.get(name)
        if voice is not None:
            return voice
        builtin = dict(VOICE_ALIASES).get(name, name)
        if builtin in self.model.speakers:
            return self.frontend.speaker(builtin)
        if any(other.voices.get(name) is not None for other in self._families()[1:]):
            raise UnknownSpeakerError(
                f"voice {name!r} has no features for model {self.model_id!r}: it was registered while "
                "that model was not served; delete it and register it again"
            )
        raise UnknownSpeakerError(f"unknown voice {name!r}")

    def _default_voice_name(self) -> str:
        if self.default_voice:
            return self.default_voice
        if self.model.speakers:
            return next(iter(self.model.speakers))
        raise InvalidRequestError(
            "no voice given and no default voice: name a voice, send prompt audio, register one "
            "(POST /v1/audio/voices) or set default_voice"
        )

    def _families(self) -> "list[SpeechService]":
        """One service per model family served, this one first: the frontends that compute,
        and the registries that store, a voice registered through this service."""
        chosen: dict[str, SpeechService] = {self.model.model_dir.family.value: self}
        for peer in self.peers:
            chosen.setdefault(peer.model.model_dir.family.value, peer)
        return list(chosen.values())

    def voice_registries(self) -> list[VoiceRegistry]:
        """The registered voices of each family served, this model's first."""
        return [service.voices for service in self._families()]

    def builtin_names(self) -> list[str]:
        """The built-in speakers of every model served, each once, sorted."""
        return sorted({name for service in (self, *self.peers) for name in service.model.speakers})

    def is_builtin(self, name: str) -> bool:
        """Whether ``name`` is a built-in speaker of any model served."""
        return any(name in service.model.speakers for service in (self, *self.peers))

    def voice_names(self) -> list[tuple[str, str]]:
        """(name, kind) of every voice, each once: ``registered`` or ``builtin``."""
        registered = sorted({n for registry in self.voice_registries() for n in registry.names()})
        return [(n, "registered") for n in registered] + [(n, "builtin") for n in self.builtin_names()]

    async def add_voice(self, name: str, audio: bytes, prompt_text: str) -> VoicePrompt:
        """Compute a recording's features once per model family served (each family's own
        frontend) and store them under ``name``; this model's voice is returned."""
        check_voice_name(name)
        families = self._families()
        if self.is_builtin(name):
            raise VoiceExistsError(f"voice {name!r} already exists")
        # The store is off the event loop: a database over the network may take seconds.
        for service in families:
            if await asyncio.to_thread(service.voices.get, name) is not None:
                raise VoiceExistsError(f"voice {name!r} already exists")
        voices = await asyncio.gather(
            *(s._run(s.frontend.voice_from_audio, audio, prompt_text, name) for s in families)
        )
        stored: list[SpeechService] = []
        try:
            for service, voice in zip(families, voices, strict=True):
                await asyncio.to_thread(service.voices.put, voice)
                stored.append(service)
        except BaseException:
            for service in stored:  # all families or none
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(service.voices.delete, name)
            raise
        return voices[0]

    def delete_voice(self, name: str) -> None:
        """Delete the registered voice ``name`` for every family."""
        check_voice_name(name)
        deleted = [registry.delete(name) for registry in self.voice_registries()]
        if not any(deleted):
            raise UnknownSpeakerError(f"unknown voice {name!r}")

    async def build_spec(self, request: SynthesisRequest, request_id: str) -> GenerationSpec:
        """The engine's input for ``request``, made on a frontend thread."""
        return await self._run(self.frontend.build_spec, request, request_id)

    async def _run(self, fn: Callable[..., _T], *args: object) -> _T:
        context = contextvars.copy_context()  # the work's log lines keep the request id
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, partial(context.run, fn, *args)
        )


def _infer_mode(params: SpeechParams, voice: VoicePrompt) -> Mode:
    if params.source_audio is not None:
        return Mode.VC
    if params.instruct:
        return Mode.INSTRUCT2
    if not voice.has_audio_prompt:
        return Mode.SFT
    return Mode.ZERO_SHOT if voice.prompt_text_ids else Mode.CROSS_LINGUAL
