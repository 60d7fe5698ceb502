"""The engine: requests in, audio chunks out, one ``step()`` at a time.

Not thread-safe: one thread drives ``step()`` (see :mod:`cosyserve.engine.async_engine`
for the asyncio front that owns that thread).
"""

import logging
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from cosyserve.engine.chunking import UPSTREAM_MAX_HOP, ChunkSchedule
from cosyserve.engine.config import EngineConfig
from cosyserve.engine.decode_graphs import Capture, CudaGraphCapture, DecodeGraphs, TraceCapture
from cosyserve.engine.lm_runner import LMRunner, NumericalError
from cosyserve.engine.request import (
    GenerationSpec,
    Phase,
    Request,
    SegmentState,
    StepOutput,
    generators_for,
)
from cosyserve.engine.scheduler import Scheduler
from cosyserve.engine.stats import EngineStats
from cosyserve.engine.token2wav import ChunkWork, Token2Wav
from cosyserve.engine.token2wav3 import DEFAULT_CACHE_BUDGET_MB, Token2Wav3
from cosyserve.errors import CosyserveError, InvalidRequestError
from cosyserve.logging_setup import request_scope
from cosyserve.models.dit import Flow3, Flow3PromptCache
from cosyserve.models.flow.flow import Flow
from cosyserve.models.flow.prompt_cache import FlowPromptCache
from cosyserve.models.flow.step_graph import CudaStepCapture
from cosyserve.models.hift.generator import HiFTGenerator
from cosyserve.models.hift3 import CausalHiFTGenerator
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.prefix_cache import PrefixCache
from cosyserve.models.sampling import LengthLimits
from cosyserve.models.speech_lm import AnySpeechLM
from cosyserve.models.trace_cache import TraceCache
from cosyserve.parallelism import call_on_own_thread

logger = logging.getLogger(__name__)


class InternalError(CosyserveError):
    """An unexpected failure while running a request; details go to the log only."""

    code = "internal_error"


class DeviceOutOfMemoryError(CosyserveError):
    """The device ran out of memory during this request; it failed, the others go on."""

    code = "out_of_memory"


class Engine:
    """Continuous batching over the LM and chunked token2wav, one request state per request."""

    def __init__(
        self,
        lm: AnySpeechLM,
        flow: Flow | Flow3,
        hift: HiFTGenerator | CausalHiFTGenerator,
        config: EngineConfig,
        decode_capture: Capture | None = None,
        trace_cache: TraceCache | None = None,
    ) -> None:
        """``decode_capture``: how decode steps are captured for replay (see
        :mod:`cosyserve.engine.decode_graphs`); by default CUDA graphs on a CUDA device if
        ``config.cuda_graphs``, TorchScript traces on a CPU if ``config.traced_decode``,
        and eager steps otherwise. ``trace_cache``: where the CPU's TorchScript traces (the
        default decode capture's and the flow's) are kept between starts; None: traced on
        every start."""
        self.config = config
        self.lm_cfg = lm.cfg
        if decode_capture is None:
            decode_capture = _default_capture(lm, config, trace_cache)
        # Steps captured in buckets take one slot more: the padded rows' scratch slot.
        slots = config.max_active + (0 if decode_capture is None or decode_capture.shape_free else 1)
        cache = KVCache.for_config(
            lm.cfg.qwen, slots, config.max_len, dtype=config.dtype, device=config.device
        )
        prefix_cache = None
        if config.prefix_cache_positions > 0:
            prefix_cache = PrefixCache.for_config(
                lm.cfg.qwen, config.prefix_cache_positions, dtype=config.dtype, device=config.device
            )
        self.stats = EngineStats()
        decode_graphs = None
        if decode_capture is not None:
            start = time.perf_counter()
            capture = partial(DecodeGraphs.for_engine, lm, cache, decode_capture, config.max_active)
            if torch.device(config.device).type == "cpu":
                # Tracing runs each step once, multi-threaded: on a thread that then exits, so
                # that no lasting thread but the engine's keeps an OpenMP pool
                # (cosyserve.parallelism).
                threads = torch.get_num_threads()
                decode_graphs = call_on_own_thread(capture, threads=threads, name="cosyserve-trace")
            else:
                decode_graphs = capture()
            elapsed = time.perf_counter() - start
            logger.info("captured %d decode steps for replay in %.1f s", len(decode_graphs.replays), elapsed)
        self.lm_runner = LMRunner(lm, cache, self.stats, prefix_cache, decode_graphs)
        # The family seam: everything after the LM is the family's own.
        self.token2wav: Token2Wav | Token2Wav3
        if isinstance(flow, Flow3):
            if not isinstance(hift, CausalHiFTGenerator):
                raise TypeError("CosyVoice 3's flow needs its causal vocoder")
            budget = config.flow_stream_cache_mb or DEFAULT_CACHE_BUDGET_MB
            cache_dtype, primed_dtype = _cache_dtypes(config, flow)
            prompt_cache3 = None
            if config.flow_prompt_cache_mb > 0 and config.flow_cache != "exact":
                mb, whole = config.flow_prompt_cache_mb, config.flow_prompt_whole
                prompt_cache3 = Flow3PromptCache(flow, mb << 20, whole, cache_dtype, primed_dtype)
            self.token2wav = Token2Wav3(
                flow,
                hift,
                self.stats,
                config.flow_cache,
                budget << 20,
                self._flow_reserved,
                prompt_cache3,
                cache_dtype,
            )
            self._hop = flow.cfg.dit.static_chunk_size // flow.cfg.token_mel_ratio
        else:
            if not isinstance(hift, HiFTGenerator):
                raise TypeError("CosyVoice 2's flow needs its vocoder")
            self.token2wav = self._cosyvoice2_token2wav(flow, hift, config, trace_cache)
            self._hop = flow.cfg.encoder.static_chunk_size
        self._lookahead = flow.cfg.pre_lookahead_len
        self.scheduler = Scheduler(config)
        self._requests: dict[str, Request] = {}

    def _cosyvoice2_token2wav(
        self, flow: Flow, hift: HiFTGenerator, config: EngineConfig, trace_cache: TraceCache | None
    ) -> Token2Wav:
        """CosyVoice 2's flow and vocoder, with their traced steps, CUDA step capture and
        primed voice prompts as ``config`` asks."""
        cpu = torch.device(config.device).type == "cpu"
        if config.traced_flow and cpu and config.flow_cache != "exact":
            # On a thread that then exits, as the decode traces above.
            start = time.perf_counter()
            threads = torch.get_num_threads()
            trace = partial(flow.trace_steps_, trace_cache)
            traced = call_on_own_thread(trace, threads=threads, name="cosyserve-trace")
            how = "traced for replay" if traced else "run eagerly"
            logger.info("flow steps %s in %.1f s", how, time.perf_counter() - start)
        device = torch.device(config.device)
        graphed = device.type == "cuda" and config.cuda_graphs
        flow.cfm.step_capture = CudaStepCapture(device) if graphed else None
        prompt_cache = None
        if config.flow_prompt_cache_mb > 0 and config.flow_cache != "exact":
            prompt_cache = FlowPromptCache(flow, config.flow_prompt_cache_mb << 20, config.flow_prompt_whole)
        return Token2Wav(
            flow,
            hift,
            self.stats,
            config.flow_cache,
            prompt_cache,
            cache_budget=config.flow_stream_cache_mb << 20,
            reserved_bytes=self._flow_reserved,
            compact_caches=config.flow_cache_compact,
            stream_rows=config.flow_stream_rows,
            cache_dtype=_cache_dtypes(config, flow)[0],
        )

    # -- requests ---------------------------------------------------------------------------

    def add(self, spec: GenerationSpec) -> None:
        """Queue a request (admission decides how many: :mod:`cosyserve.engine.admission`)."""
        if spec.request_id in self._requests:
            raise InvalidRequestError(f"request id {spec.request_id!r} is already in use")
        if not spec.segments:
            raise InvalidRequestError("nothing to synthesise")
        lm_gen, vocoder_gen = generators_for(spec.seed)
        request = Request(
            spec=spec,
            segments=[self._segment_state(spec, i) for i in range(len(spec.segments))],
            lm_generator=lm_gen,
            vocoder_generator=vocoder_gen,
        )
        self.scheduler.add(request)
        self._requests[spec.request_id] = request

    def abort(self, request_id: str) -> bool:
        """Drop a request now, freeing its KV slot and caches. False if it is unknown."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self._release(request)
        return True

    def abort_all(self) -> int:
        """Drop every request (at shutdown); returns how many there were."""
        requests = list(self._requests)
        for request_id in requests:
            self.abort(request_id)
        return len(requests)

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.lm_runner.prefix_cache

    @property
    def flow_prompt_cache(self) -> FlowPromptCache | Flow3PromptCache | None:
        return self.token2wav.prompt_cache

    def has_work(self) -> bool:
        return bool(self._requests)

    @property
    def active_requests(self) -> int:
        return len(self._requests)

    def _segment_state(self, spec: GenerationSpec, index: int) -> SegmentState:
        segment = spec.segments[index]
        prompt_tokens = int(spec.flow_prompt_tokens.numel())
        first_hop = spec.first_hop if spec.first_hop is not None else self.config.first_hop
        schedule = ChunkSchedule(
            prompt_tokens,
            hop=self._hop,
            lookahead=self._lookahead,
            first_hop=first_hop,
            max_hop=UPSTREAM_MAX_HOP if self.config.hop_growth else None,
        )
        if segment.speech_tokens is not None:
            return SegmentState(segment, schedule, None, tokens=list(segment.speech_tokens), lm_done=True)
        if spec.min_tokens is not None or spec.max_tokens is not None:
            lo = spec.min_tokens or 0
            hi = spec.max_tokens if spec.max_tokens is not None else max(lo, 1)
            limits = LengthLimits.forced(lo, max(hi, lo), self.lm_cfg)
        else:
            limits = LengthLimits.for_text(len(segment.text_ids), self.lm_cfg)
        return SegmentState(segment, schedule, limits, lm_done=limits.max_tokens == 0)

    def _flow_reserved(self) -> int:
        """Bytes reserved by the stream caches of the requests still running."""
        return sum(seg.flow_reserved for request in self.scheduler.running for seg in request.segments)

    def _release(self, request: Request) -> None:
        self.scheduler.remove(request)
        if request.slot is not None:
            self.lm_runner.cache.free(request.slot)
            request.slot = None
        request.prefill_input = None
        request.prefill_ids = None
        request.phase = Phase.FINISHED

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Admit, prefill, decode one token for everyone decoding, run token2wav chunks."""
        outputs: list[StepOutput] = []
        for request in self.scheduler.admit():
            self._guard(request, outputs, partial(self._start_lm, request))
        for request, n in self.scheduler.prefill_work():
            self._guard(request, outputs, partial(self.lm_runner.prefill, request, n))
        batch = self.scheduler.decode_batch()
        if batch:
            self._decode(batch, outputs)
        for request in list(self.scheduler.running):
            if request.id in self._requests:
                self._guard(request, outputs, partial(self._advance_lm, request))
        work = [ChunkWork(*ready) for ready in self.scheduler.vocode_work() if ready[0].id in self._requests]
        if work:
            self._vocode(work, outputs)
        return outputs

    def _decode(self, batch: list[Request], outputs: list[StepOutput]) -> None:
        cache = self.lm_runner.cache
        lengths = [cache.length(r.slot) for r in batch if r.slot is not None]
        try:
            failed = self.lm_runner.decode(batch)
        except Exception:
            logger.exception("batched decode of %d requests failed; retrying one by one", len(batch))
            # A batch-wide failure cannot be pinned on one request: undo the step and retry
            # one by one, so that only the request that fails fails.
            for request, length in zip(batch, lengths, strict=True):
                assert request.slot is not None
                cache.truncate(request.slot, length)
            for request in batch:
                self._guard(request, outputs, partial(self._decode_alone, request))
            return
        for request in failed:
            self._fail(request, NumericalError("non-finite LM output", [request.id]), outputs)

    def _decode_alone(self, request: Request) -> None:
        if self.lm_runner.decode([request]):
            raise NumericalError("non-finite LM output", [request.id])

    def _guard(self, request: Request, outputs: list[StepOutput], work: Callable[[], object]) -> None:
        """Run one request's piece of work; its failure fails that request only."""
        if request.id not in self._requests:
            return
        with request_scope(request.spec.log_id or request.id):
            try:
                work()
            except CosyserveError as exc:
                self._fail(request, exc, outputs)
            except torch.OutOfMemoryError:
                logger.error(
                    "request %s ran out of device memory: it fails (503), its memory is freed", request.id
                )
                self._fail(request, DeviceOutOfMemoryError("out of device memory; retry later"), outputs)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()  # return the failed request's blocks to the device
            except torch.AcceleratorError:
                raise  # the device itself is broken: the engine loop stops (engine_dead)
            except Exception:
                logger.exception("request %s failed", request.id)
                self._fail(request, InternalError("synthesis failed"), outputs)

    def _fail(self, request: Request, error: CosyserveError, outputs: list[StepOutput]) -> None:
        if self._requests.pop(request.id, None) is None:
            return
        self._release(request)
        self.stats.failures[error.code] = self.stats.failures.get(error.code, 0) + 1
        outputs.append(StepOutput(request.id, finished=True, error=error))

    def _start_lm(self, request: Request) -> None:
        """Give an admitted request a slot and start its first segment that needs the LM."""
        self._skip_lm_free_segments(request)
        if request.lm_segment >= len(request.segments):
            request.phase = Phase.VOCODE
            return
        request.slot = self.lm_runner.cache.allocate()
        self.lm_runner.start_segment(request)

    def _skip_lm_free_segments(self, request: Request) -> None:
        while request.lm_segment < len(request.segments) and request.lm_state.lm_done:
            request.lm_segment += 1

    def _advance_lm(self, request: Request) -> None:
        """After a finished segment, start the next one in a fresh slot, or leave the LM."""
        if request.phase is not Phase.DECODE or not request.lm_state.lm_done:
            return
        assert request.slot is not None
        self.lm_runner.cache.free(request.slot)
        request.slot = None
        request.lm_segment += 1
        self._skip_lm_free_segments(request)
        if request.lm_segment >= len(request.segments):
            request.phase = Phase.VOCODE
            return
        request.slot = self.lm_runner.cache.allocate()
        self.lm_runner.start_segment(request)

    def _vocode(self, work: list[ChunkWork], outputs: list[StepOutput]) -> None:
        """Run the step's ready chunks as batches; each failure fails its own request only."""
        voiced = [item for item in work if item.chunk.token_end > 0]
        audio = dict(zip(voiced, self.token2wav.run(voiced), strict=True))
        for item in work:
            result = audio.get(item, _silence())
            self._guard(item.request, outputs, partial(self._emit, item, result, outputs))

    def _emit(self, item: ChunkWork, audio: np.ndarray | Exception, outputs: list[StepOutput]) -> None:
        if isinstance(audio, Exception):
            raise audio  # _guard turns it into this request's failure
        request, seg, chunk = item.request, item.seg, item.chunk
        if request.spec.stream:
            seg.schedule.advance(chunk)
        if chunk.finalize:
            seg.vocoded = True
            request.vocode_segment += 1
        first = not request.emitted_audio
        request.emitted_audio = True
        done = request.vocode_segment >= len(request.segments)
        tokens = tuple(t for s in request.segments for t in s.tokens) if done else None
        outputs.append(
            StepOutput(request.id, audio=audio, finished=done, first_chunk=first, speech_tokens=tokens)
        )
        if done:
            self._requests.pop(request.id, None)
            self._release(request)


def _default_capture(lm: AnySpeechLM, config: EngineConfig, trace_cache: TraceCache | None) -> Capture | None:
    device = torch.device(config.device)
    if device.type == "cuda":
        return CudaGraphCapture(device) if config.cuda_graphs else None
    return TraceCapture(lm, trace_cache) if config.traced_decode and device.type == "cpu" else None


def _silence() -> np.ndarray:
    return np.zeros(0, dtype=np.float32)


def _cache_dtypes(config: EngineConfig, flow: Flow | Flow3) -> tuple[torch.dtype | None, torch.dtype | None]:
    """What streams hold their own flow caches in and what voices' primed prompts are
    held in, as ``config.flow_cache_dtype`` asks (None: as the flow computes). float16
    applies to a float32 flow only; int8 holds a stream's own positions, while the primed
    ones, which all the voice's streams read, stay float16 (a float32 flow) or as computed."""
    narrow = torch.float16 if flow.speaker_proj.weight.dtype == torch.float32 else None
    if config.flow_cache_dtype == "int8":
        return torch.int8, narrow
    if config.flow_cache_dtype == "fp16":
        return narrow, narrow
    return None, None
