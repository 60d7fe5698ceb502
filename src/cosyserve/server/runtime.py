"""What one server process runs, from model loading to shutdown.

:class:`ServerRuntime` opens the voice store, and for each model directory loads the
model, starts its engine thread, builds its :class:`~cosyserve.server.service.SpeechService`
and warms up; on shutdown it stops everything in order. The app factory keeps it on
``app.state.runtime`` (and the default model's service on ``app.state.service`` once
ready); nothing lives at module level.

Lifecycle: ``starting`` (loading, warm-up; ``/ready`` answers 503) -> ``ready`` ->
``draining`` (SIGTERM: no new requests, in-flight ones finish within the grace period) ->
``stopped``. A start that fails ends in ``failed`` and calls ``on_fatal``.
"""

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from enum import StrEnum
from pathlib import Path

import grpc
import torch

from cosyserve.accel.machine import Machine
from cosyserve.accel.plan import Plan, choose_plan
from cosyserve.engine.async_engine import AsyncEngine
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel, engine_config_for, load_model
from cosyserve.errors import CosyserveError
from cosyserve.models.trace_cache import TraceCache
from cosyserve.parallelism import hand_over_threads
from cosyserve.pipeline.request import MIN_FIRST_HOP, Mode, SynthesisOptions, SynthesisRequest
from cosyserve.pipeline.voice import VoicePrompt
from cosyserve.server.error_map import ModelNotFoundError, NotReadyError
from cosyserve.server.grpc import GrpcConfig, start_grpc_server
from cosyserve.server.guard import InputGuard
from cosyserve.server.guarded_service import GuardedService
from cosyserve.server.pronunciations import PronunciationFile
from cosyserve.server.service import ServiceLimits, SpeechService
from cosyserve.server.settings import Settings
from cosyserve.voices import VoiceStore, open_voice_store

logger = logging.getLogger(__name__)


class Phase(StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class ServerRuntime:
    """The models, engines, voice store, services and gRPC server of one process.

    Each model directory of ``settings.model_dir`` gets its own engine and
    :class:`SpeechService`, kept by model id: the directory's name (the first is the
    default model). A family's name (``cosyvoice2``, ``cosyvoice3``) is an alias of its
    model where one model of that family is served and no model has that id."""

    def __init__(
        self,
        settings: Settings,
        on_fatal: Callable[[], None] | None = None,
        guard: InputGuard | None = None,
        grpc_interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self.settings = settings
        # The input guard and the gRPC access control (server/guard.py, server/auth/).
        self.guard = guard or InputGuard()
        self.grpc_interceptors = grpc_interceptors
        self.phase = Phase.STARTING
        self.plan: Plan | None = None  # the default model's, chosen at start
        self.service: SpeechService | None = None  # the default model's
        # Every model's service by id, in model_dir's order, as each is built.
        self.models: dict[str, SpeechService] = {}
        self._pronunciations: PronunciationFile | None = None
        self._aliases: dict[str, str] = {}
        self._warmed: set[str] = set()
        self._on_fatal = on_fatal
        self._voices: VoiceStore | None = None
        self._grpc: grpc.aio.Server | None = None
        self._grpc_stopping: asyncio.Future[None] | None = None

    @property
    def model_ids(self) -> list[str]:
        """The ids of the served models, the default first (known before they load)."""
        return [path.name for path in self.settings.model_dir]

    @property
    def services(self) -> list[SpeechService]:
        """The services built so far, the default first."""
        return list(self.models.values())

    def model_states(self) -> dict[str, str]:
        """Each model's state by id: ``loading``, ``warming_up``, ``ready`` or ``engine_dead``."""
        states = {}
        for model_id in self.model_ids:
            service = self.models.get(model_id)
            if service is None:
                states[model_id] = "loading"
            elif not service.engine.alive:
                states[model_id] = "engine_dead"
            else:
                states[model_id] = "ready" if model_id in self._warmed else "warming_up"
        return states

    @property
    def engine_alive(self) -> bool:
        """Every model's engine thread runs (False before they all started)."""
        engines = [service.engine for service in self.models.values()]
        return len(engines) == len(self.settings.model_dir) and all(engine.alive for engine in engines)

    @property
    def engine_requests(self) -> int:
        """Requests inside the engines (queued or running); 0 before they start."""
        return sum(service.engine.active_requests for service in self.models.values())

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY and self.engine_alive

    def require_service(self, model: str | None = None) -> SpeechService:
        """The service of ``model`` (an id or a family alias; None: the default model's), if
        requests are being accepted; else :class:`NotReadyError` (503). With one model served
        any name picks it; with several an unknown one raises :class:`ModelNotFoundError`."""
        if self.phase is not Phase.READY or self.service is None:
            raise NotReadyError(f"the server is not accepting requests ({self.phase.value})")
        if model is None or len(self.models) == 1:
            return self.service
        found = self.models.get(model) or self.models.get(self._aliases.get(model, ""))
        if found is None:
            raise ModelNotFoundError(
                f"model {model!r} is not served here; served models: {', '.join(self.models)}"
            )
        return found

    async def start(
        self, fingerprints: Sequence[str] | None = None, verify: Callable[[], None] | None = None
    ) -> None:
        """Load, build and warm up every model; then the phase is ``ready`` (or ``failed``).

        ``fingerprints``: the model directories' (:mod:`~cosyserve.server.preflight`), one
        each, which key the TorchScript traces kept between starts (None: traced on every
        start). ``verify``: a check of the models' files that raises where they are damaged,
        run on a thread meanwhile (hashing the full model's took about as long as loading
        it); its error fails the start, and explains a failure of the start before it.

        The models load one after the other (each model's loading peak is passed before the
        next starts), and share the voice store: each family reads its own voices
        (:meth:`~cosyserve.voices.VoiceStore.for_family`)."""
        settings = self.settings
        started = time.perf_counter()
        # The event loop never runs model work: the engines' threads get its torch threads.
        threads = hand_over_threads()
        verifying = None if verify is None else asyncio.ensure_future(asyncio.to_thread(verify))
        try:
            plan = choose_plan(Machine.detect(), settings.profile, settings.choices(), threads)
            self.plan = plan
            logger.info("plan: %s", plan.describe())
            self._voices = await asyncio.to_thread(open_voice_store, settings.voices_db)
            logger.info("voices: %s", self._voices.location)
            for index, path in enumerate(settings.model_dir):
                fingerprint = None if fingerprints is None else fingerprints[index]
                service = await self._start_model(path, plan, threads, fingerprint)
                if index == 0:
                    self.plan = service.model.plan
                    self.service = service
            self._aliases = _family_aliases(self.models)
            self._pronunciations = PronunciationFile(settings.pronunciations)
            self._pronunciations.apply(self.services)
            for service in self.models.values():
                service.peers = tuple(other for other in self.models.values() if other is not service)
            if settings.grpc_port:
                assert self.service is not None
                grpc_config = GrpcConfig(
                    max_text_chars=settings.max_text_chars, max_message_bytes=settings.max_upload_bytes
                )
                self._grpc = await start_grpc_server(
                    self.service, settings.host, settings.grpc_port, grpc_config, self.grpc_interceptors
                )
            if verifying is not None:
                await verifying
        except Exception as exc:
            error = await _explained(exc, verifying)
            if isinstance(error, CosyserveError | OSError):
                logger.error("server start failed: %s", error)
            else:
                logger.error("server start failed", exc_info=error)
            self._fail()
            return
        finally:
            if verifying is not None:
                verifying.cancel()  # a cancelled start does not wait for it
        self.phase = Phase.READY
        logger.info(
            "ready: model%s %s, started in %.1f s",
            "s" if len(self.models) > 1 else "",
            ", ".join(str(path) for path in settings.model_dir),
            time.perf_counter() - started,
        )

    def reload_pronunciations(self) -> bool:
        """Read the pronunciation dictionary again (SIGHUP) for every served model; a file
        that fails to read or parse keeps the dictionaries in use. True if replaced."""
        if self._pronunciations is None:
            return False
        try:
            self._pronunciations.apply(self.services)
        except CosyserveError as exc:
            logger.error("pronunciations not reloaded, the old ones stay: %s", exc)
            return False
        return True

    async def _start_model(
        self, path: Path, plan: Plan, threads: int, fingerprint: str | None
    ) -> SpeechService:
        """Load the model in ``path``, start its engine, build its service and warm it up;
        the service is in :attr:`models` (so :meth:`stop` stops it) once its engine runs."""
        settings = self.settings
        model = await asyncio.to_thread(load_model, path, plan)
        assert self._voices is not None
        voices = await asyncio.to_thread(self._voices.for_family, model.model_dir.family.value)
        if model.plan != plan:  # the model family's own (a CosyVoice 3 flow has fewer variants)
            logger.info("plan for %s: %s", model.model_dir.family, model.plan.describe())
        config = engine_config_for(
            model,
            max_active=settings.max_active,
            max_waiting=settings.max_queued,
            flow_prompt_cache_mb=settings.flow_prompt_cache_mb,
        )
        traces = None if fingerprint is None else TraceCache.create(_trace_key(fingerprint, model))
        # Off the event loop: the engine captures its decode steps as it is made.
        engine = await asyncio.to_thread(Engine, model.lm, model.flow, model.hift, config, trace_cache=traces)
        async_engine = AsyncEngine(engine, threads=threads)
        await asyncio.to_thread(async_engine.start)
        try:
            service = GuardedService(
                model,
                async_engine,
                voices,
                ServiceLimits(deadline_s=settings.deadline_s or None),
                guard=self.guard,
                default_voice=settings.default_voice,
            )
        except BaseException:
            await asyncio.to_thread(async_engine.shutdown)
            raise
        service.model_id = path.name
        self.models[path.name] = service
        await self._warm_up(service)
        self._warmed.add(path.name)
        if len(settings.model_dir) > 1:
            logger.info("model %s (%s) ready", path.name, model.model_dir.family.value)
        return service

    async def _warm_up(self, service: SpeechService) -> None:
        """One short streamed synthesis with forced tokens, so the first real request does
        not pay for lazy initialisation (allocator, kernels, caches). It takes each path a
        request takes (prefill, decode, a streamed and a final chunk of flow and vocoder) on
        the fewest tokens: longer chunks cost seconds of start-up to repeat the same work
        (the replayed traces' first runs were made when they were captured). The memory a
        request's longer chunks need beyond these is faulted in by the first (about 85 MiB,
        tens of milliseconds, on the full model), or at start with ``pretouch_mb``."""
        model = service.model
        embedding = torch.zeros(model.hparams.flow.spk_embed_dim)
        # A streamed chunk of MIN_FIRST_HOP tokens and the look-ahead it sees, which then
        # make the final chunk.
        tokens = MIN_FIRST_HOP + model.hparams.flow.pre_lookahead_len
        request = SynthesisRequest(
            "warm up.",
            Mode.SFT,
            voice=VoicePrompt.from_embedding(embedding, "warmup"),
            stream=True,
            options=SynthesisOptions(seed=0, min_tokens=tokens, max_tokens=tokens, first_hop=MIN_FIRST_HOP),
        )
        spec = await service.build_spec(request, "warmup")
        samples = 0
        start = time.perf_counter()
        async for chunk in service.engine.generate(spec):
            samples += chunk.audio.size
        logger.info("warm-up done: %d samples in %.1f s", samples, time.perf_counter() - start)

    def _fail(self) -> None:
        self.phase = Phase.FAILED
        if self._on_fatal is not None:
            self._on_fatal()

    async def drain(self) -> None:
        """Stop taking new requests (``/ready`` turns 503, gRPC refuses new calls);
        in-flight ones go on."""
        if self.phase in (Phase.STARTING, Phase.READY):
            self.phase = Phase.DRAINING
            logger.info("draining: no new requests")
        if self._grpc is not None and self._grpc_stopping is None:
            # In-flight calls get the grace period, like HTTP ones (the engine cut-off ends them).
            self._grpc_stopping = asyncio.ensure_future(self._grpc.stop(self.settings.shutdown_grace_s))

    async def cut_off(self, grace_s: float) -> None:
        """After ``grace_s``, stop the engines: every request still running ends with
        ``engine_dead``, so draining never outlasts the grace period."""
        await asyncio.sleep(grace_s)
        for service in self.models.values():
            if service.engine.alive:
                logger.warning("grace period over: aborting %d request(s)", service.engine.active_requests)
                await asyncio.to_thread(service.engine.shutdown)

    async def stop(self) -> None:
        """Stop the engine threads (aborting what still runs), the executors and the store."""
        await self.drain()
        if self._grpc_stopping is not None:
            await self._grpc_stopping
        for service in self.models.values():
            await asyncio.to_thread(service.engine.shutdown)
        for service in self.models.values():
            await asyncio.to_thread(service.close)
        if self._voices is not None:
            self._voices.close()
        if self.phase is not Phase.FAILED:
            self.phase = Phase.STOPPED
        logger.info("stopped")


def _family_aliases(models: dict[str, SpeechService]) -> dict[str, str]:
    """Family name -> model id, for each family with one model served whose name is no id."""
    by_family: dict[str, list[str]] = {}
    for model_id, service in models.items():
        by_family.setdefault(service.model.model_dir.family.value, []).append(model_id)
    aliases = {}
    for family, ids in by_family.items():
        if len(ids) == 1 and family not in models:
            aliases[family] = ids[0]
        elif len(ids) > 1:
            logger.info("models %s are both %s: the family's name picks neither", ", ".join(ids), family)
    return aliases


def _trace_key(fingerprint: str, model: LoadedModel) -> str:
    """What names ``model``'s traces: its files, its configuration, its plan (precision,
    kernels, attention path: all shape what is traced) and the machine it was made for."""
    plan = model.plan
    return f"model {fingerprint}\n{model.hparams!r}\n{plan.describe()}\n{plan.machine!r}"


async def _explained(error: Exception, verifying: "asyncio.Future[None] | None") -> BaseException:
    """``error``, or the model files' check's where it found them damaged: a damaged file
    explains a failed load better than the load's own error does."""
    if verifying is None:
        return error
    try:
        await verifying
    except Exception as failure:  # the check's own bug leaves the start's error standing
        return failure if isinstance(failure, CosyserveError | OSError) else error
    return error
