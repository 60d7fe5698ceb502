"""What one server process runs, from model loading to shutdown.

:class:`ServerRuntime` loads the model, starts the engine thread, opens the voice store,
builds the :class:`~cosyserve.server.service.SpeechService`, warms up, and on shutdown
stops everything in order. The app factory keeps it on ``app.state.runtime`` (and the
service on ``app.state.service`` once ready); nothing lives at module level.

Lifecycle: ``starting`` (loading, warm-up; ``/ready`` answers 503) -> ``ready`` ->
``draining`` (SIGTERM: no new requests, in-flight ones finish within the grace period) ->
``stopped``. A start that fails ends in ``failed`` and calls ``on_fatal``.
"""

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from enum import StrEnum

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
from cosyserve.server.error_map import NotReadyError
from cosyserve.server.grpc import GrpcConfig, start_grpc_server
from cosyserve.server.guard import InputGuard
from cosyserve.server.guarded_service import GuardedService
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
    """The model, engine, voice store, service and gRPC server of one process."""

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
        self.plan: Plan | None = None  # chosen at start
        self.service: SpeechService | None = None
        self._on_fatal = on_fatal
        self._engine: AsyncEngine | None = None
        self._voices: VoiceStore | None = None
        self._grpc: grpc.aio.Server | None = None
        self._grpc_stopping: asyncio.Future[None] | None = None

    @property
    def engine_alive(self) -> bool:
        return self._engine is not None and self._engine.alive

    @property
    def engine_requests(self) -> int:
        """Requests inside the engine (queued or running); 0 before the engine starts."""
        return 0 if self._engine is None else self._engine.active_requests

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY and self.engine_alive

    def require_service(self) -> SpeechService:
        """The service, if requests are being accepted; else :class:`NotReadyError` (503)."""
        if self.phase is not Phase.READY or self.service is None:
            raise NotReadyError(f"the server is not accepting requests ({self.phase.value})")
        return self.service

    async def start(self, fingerprint: str | None = None, verify: Callable[[], None] | None = None) -> None:
        """Load, build and warm up; then the phase is ``ready`` (or ``failed``).

        ``fingerprint``: the model directory's (:mod:`~cosyserve.server.preflight`), which
        keys the TorchScript traces kept between starts (None: traced on every start).
        ``verify``: a check of the model's files that raises where they are damaged, run
        on a thread meanwhile (hashing the full model's took about as long as loading it);
        its error fails the start, and explains a failure of the start before it."""
        settings = self.settings
        started = time.perf_counter()
        # The event loop never runs model work: the engine's thread gets its torch threads.
        threads = hand_over_threads()
        verifying = None if verify is None else asyncio.ensure_future(asyncio.to_thread(verify))
        try:
            plan = choose_plan(Machine.detect(), settings.profile, settings.choices(), threads)
            self.plan = plan
            logger.info("plan: %s", plan.describe())
            model = await asyncio.to_thread(load_model, settings.model_dir, plan)
            config = engine_config_for(
                model,
                max_active=settings.max_active,
                max_waiting=settings.max_queued,
                flow_prompt_cache_mb=settings.flow_prompt_cache_mb,
            )
            traces = None if fingerprint is None else TraceCache.create(_trace_key(fingerprint, model))
            # Off the event loop: the engine captures its decode steps as it is made.
            engine = await asyncio.to_thread(
                Engine, model.lm, model.flow, model.hift, config, trace_cache=traces
            )
            self._engine = AsyncEngine(engine, threads=threads)
            await asyncio.to_thread(self._engine.start)
            self._voices = await asyncio.to_thread(open_voice_store, settings.voices_db)
            logger.info("voices: %s", self._voices.location)
            limits = ServiceLimits(deadline_s=settings.deadline_s or None)
            service = GuardedService(
                model,
                self._engine,
                self._voices,
                limits,
                guard=self.guard,
                default_voice=settings.default_voice,
            )
            self.service = service
            await self._warm_up(service)
            if settings.grpc_port:
                grpc_config = GrpcConfig(
                    max_text_chars=settings.max_text_chars, max_message_bytes=settings.max_upload_bytes
                )
                self._grpc = await start_grpc_server(
                    service, settings.host, settings.grpc_port, grpc_config, self.grpc_interceptors
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
        logger.info("ready: model %s, started in %.1f s", settings.model_dir, time.perf_counter() - started)

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
        assert self._engine is not None
        samples = 0
        start = time.perf_counter()
        async for chunk in self._engine.generate(spec):
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
        """After ``grace_s``, stop the engine: every request still running ends with
        ``engine_dead``, so draining never outlasts the grace period."""
        await asyncio.sleep(grace_s)
        if self._engine is not None and self._engine.alive:
            logger.warning("grace period over: aborting %d request(s)", self._engine.active_requests)
            await asyncio.to_thread(self._engine.shutdown)

    async def stop(self) -> None:
        """Stop the engine thread (aborting what still runs), the executors and the store."""
        await self.drain()
        if self._grpc_stopping is not None:
            await self._grpc_stopping
        if self._engine is not None:
            await asyncio.to_thread(self._engine.shutdown)
        if self.service is not None:
            await asyncio.to_thread(self.service.close)
        if self._voices is not None:
            self._voices.close()
        if self.phase is not Phase.FAILED:
            self.phase = Phase.STOPPED
        logger.info("stopped")


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
