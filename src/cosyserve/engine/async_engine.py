"""The asyncio front of the engine: one dedicated thread steps the engine; coroutines
submit requests and receive their audio chunks through per-request queues.

Model work never runs on the event loop. The engine thread sleeps on a condition
variable while there is nothing to do (no polling), and hands each output to its
request's event loop with ``call_soon_threadsafe``. The engine thread is the process's
one long-lived thread that runs torch multi-threaded (see :mod:`cosyserve.parallelism`).
"""

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import numpy as np
import torch

from cosyserve.engine.admission import Admission
from cosyserve.engine.engine import Engine
from cosyserve.engine.request import GenerationSpec, StepOutput
from cosyserve.errors import CosyserveError, InvalidRequestError
from cosyserve.memory import retain_freed_memory
from cosyserve.parallelism import pin_torch_threads

logger = logging.getLogger(__name__)

_NO_AUDIO = np.zeros(0, dtype=np.float32)


class EngineDeadError(CosyserveError):
    """The engine thread stopped after an unrecoverable error; the server is not ready."""

    code = "engine_dead"


@dataclass(frozen=True)
class AudioChunk:
    """Samples (float32 mono at the model's rate) and whether they are the request's first.

    ``speech_tokens`` is set on the request's last chunk only (which may hold no samples):
    every speech token the audio was made from.
    """

    audio: np.ndarray
    first: bool
    speech_tokens: tuple[int, ...] | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: "asyncio.Queue[StepOutput]"


class AsyncEngine:
    """Thread-owning wrapper of :class:`Engine`; start with :meth:`start`, stop with :meth:`shutdown`.

    ``threads``: the engine thread's torch threads (None: the constructing thread's
    count; :func:`~cosyserve.parallelism.hand_over_threads` gives a caller's count away)."""

    def __init__(self, engine: Engine, threads: int | None = None) -> None:
        self.engine = engine
        self.threads = torch.get_num_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"the engine thread needs at least one torch thread, not {self.threads}")
        self._cond = threading.Condition()
        self._pending_add: list[GenerationSpec] = []
        self._pending_abort: list[str] = []
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self.error: BaseException | None = None
        # The process's one gate: requests held, from admission to their last chunk.
        self.admission = Admission(engine.config.max_active + engine.config.max_waiting)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine thread is already started")
        # Before the engine's thread makes its arena: the streams' caches reuse freed memory.
        retain_freed_memory()
        self._thread = threading.Thread(target=self._run, name="cosyserve-engine", daemon=True)
        self._thread.start()
        # Back once the thread is ready (its torch threads pinned) or has died trying.
        self._started.wait()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still running are aborted and told so."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def active_requests(self) -> int:
        with self._cond:
            return len(self._streams)

    async def generate(
        self, spec: GenerationSpec, admitted: bool = False
    ) -> AsyncGenerator[AudioChunk, None]:
        """Submit ``spec`` and yield its audio as it is made. Raises the request's
        :class:`CosyserveError` if it fails, and :class:`OverloadedError` at once when
        :attr:`admission` has no place (unless ``admitted``: the caller holds one). Leaving
        the iteration early (a client that disconnects, a cancelled task) aborts the
        request in the engine."""
        if admitted:
            async for chunk in self._generate(spec):
                yield chunk
            return
        with self.admission.place():
            async for chunk in self._generate(spec):
                yield chunk

    async def _generate(self, spec: GenerationSpec) -> AsyncGenerator[AudioChunk, None]:
        if not self.alive:
            raise EngineDeadError("the synthesis engine is not running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._cond:
            if spec.request_id in self._streams:
                raise InvalidRequestError(f"request id {spec.request_id!r} is already in use")
            self._streams[spec.request_id] = stream
            self._pending_add.append(spec)
            self._cond.notify_all()
        finished = False
        try:
            while not finished:
                out = await stream.queue.get()
                if out.error is not None:
                    finished = True
                    raise out.error
                audio = out.audio if out.audio is not None else _NO_AUDIO
                if audio.size or out.finished:
                    yield AudioChunk(audio, out.first_chunk, out.speech_tokens)
                finished = out.finished
        finally:
            if not finished:
                self.abort(spec.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its slot and caches are freed at the start of the next step."""
        with self._cond:
            if self._streams.pop(request_id, None) is not None:
                self._pending_abort.append(request_id)
                self._cond.notify_all()

    def _run(self) -> None:
        try:
            pin_torch_threads(self.threads)
            self._started.set()
            while True:
                with self._cond:
                    while not (
                        self._stopping or self._pending_add or self._pending_abort or self.engine.has_work()
                    ):
                        self._cond.wait()
                    if self._stopping:
                        break
                    adds, self._pending_add = self._pending_add, []
                    aborts, self._pending_abort = self._pending_abort, []
                for request_id in aborts:
                    self.engine.abort(request_id)
                for spec in adds:
                    self._add(spec)
                if self.engine.has_work():
                    for out in self.engine.step():
                        self._deliver(out)
        except BaseException as exc:  # the loop itself broke: the engine is unusable
            logger.exception(
                "engine thread died: every request fails with engine_dead and /ready answers 503; "
                "restart the process (a device error may need the GPU checked first)"
            )
            self.error = exc
        finally:
            self._started.set()
            self._fail_all(EngineDeadError("the synthesis engine stopped"))
            with self._cond:
                self._pending_add.clear()
                self._pending_abort.clear()
            self.engine.abort_all()  # requests whose consumers left before the end

    def _add(self, spec: GenerationSpec) -> None:
        try:
            self.engine.add(spec)
        except CosyserveError as exc:
            self._deliver(StepOutput(spec.request_id, finished=True, error=exc))

    def _deliver(self, out: StepOutput) -> None:
        with self._cond:
            stream = self._streams.get(out.request_id)
            if stream is not None and out.finished:
                del self._streams[out.request_id]
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            with self._cond:
                self._streams.pop(out.request_id, None)
            self.engine.abort(out.request_id)

    def _fail_all(self, error: CosyserveError) -> None:
        with self._cond:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self.engine.abort(request_id)
            out = StepOutput(request_id, finished=True, error=error)
            with contextlib.suppress(RuntimeError):  # that event loop is already closed
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
