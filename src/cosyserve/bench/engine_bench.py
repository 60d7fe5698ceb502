"""``cosyserve bench engine``: latency and throughput of the engine at several concurrency
levels, on the fixed synthetic workload of :mod:`cosyserve.bench.workload`.

Each level runs ``rounds * concurrency`` requests through one :class:`AsyncEngine`, with
``concurrency`` asyncio tasks each submitting its next request when the previous one ends
(a closed loop), so that the engine always holds ``concurrency`` requests. Every request
speaks its own text with the same voice and forces ``tokens`` speech tokens.
"""

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from cosyserve.bench.workload import family_prompt, synthetic_spec, synthetic_text_ids, synthetic_voice
from cosyserve.engine.async_engine import AsyncEngine
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel, engine_config_for
from cosyserve.engine.request import GenerationSpec
from cosyserve.errors import InvalidRequestError
from cosyserve.parallelism import hand_over_threads
from cosyserve.pipeline.voice import VoicePrompt

WARM_UP_TOKENS = 30


@dataclass(frozen=True)
class BenchOptions:
    """What to run. ``first_hop``: tokens in a stream's first chunk (None: the plan's)."""

    tokens: int = 150
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    stream: bool = False
    prompt_seconds: float = 3.0
    rounds: int = 2
    seed: int = 0
    first_hop: int | None = None
    warm_up: bool = True

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.rounds < 1 or self.prompt_seconds <= 0:
            raise InvalidRequestError("tokens and rounds must be at least 1, prompt seconds above 0")
        if not self.concurrency or min(self.concurrency) < 1:
            raise InvalidRequestError("concurrency levels must be at least 1")


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> "Percentiles":
        p50, p95, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 95, 99]).tolist()
        return cls(p50, p95, p99)


@dataclass(frozen=True)
class RequestTiming:
    """Seconds from submission to the first chunk and to the end; audio seconds made."""

    first_chunk_s: float
    total_s: float
    audio_s: float
    tokens: int


@dataclass(frozen=True)
class LevelResult:
    """One concurrency level. ``rtf``: mean over requests of total time / audio time.
    ``lm_tokens_per_s``: speech tokens generated per wall second (all requests);
    ``lm_busy_tokens_per_s``: the same per second the LM actually ran (prefill + decode).
    ``peak_rss_mb``: the process's peak RSS during the level (``rss_peak_is_level``: False
    where the kernel would not reset the peak, so it is the peak since start).
    ``peak_device_mb``: on a CUDA device, the most tensor memory allocated on it during the
    level (None on the CPU).
    ``stage_s``: engine seconds per stage (prefill, decode, flow, hift) during the level."""

    concurrency: int
    requests: int
    wall_s: float
    first_chunk_s: Percentiles
    total_s: Percentiles
    rtf: float
    audio_s_per_s: float
    lm_tokens_per_s: float
    lm_busy_tokens_per_s: float
    peak_rss_mb: float
    rss_peak_is_level: bool
    peak_device_mb: float | None
    prefix_reused_positions: int
    prefill_positions: int
    stage_s: dict[str, float]
    load_average: tuple[float, float, float]


@dataclass(frozen=True)
class BenchReport:
    """``plan``: how the model was loaded and runs (:meth:`Plan.labels`); ``kv_cache_dtype``:
    the engine's KV cache dtype (e.g. ``bfloat16``), which follows the precision."""

    model_dir: str
    options: BenchOptions
    torch_threads: int
    cpu_count: int
    plan: dict[str, str]
    kv_cache_dtype: str
    load_average_before: tuple[float, float, float]
    levels: list[LevelResult] = field(default_factory=list)


def run_engine_bench(
    model: LoadedModel,
    options: BenchOptions,
    on_request_done: Callable[[int], None] | None = None,
) -> BenchReport:
    """Run every level of ``options`` on ``model``; ``on_request_done(concurrency)`` is
    called after each measured request (for a progress bar). The calling thread hands its
    torch threads to the engine's thread and keeps one, as a server's event loop does."""
    threads = hand_over_threads()
    hp = model.hparams
    # The LM prompt a real zero-shot request of this family gets (CosyVoice 3's system prompt).
    voice = family_prompt(
        model.model_dir, synthetic_voice(hp, options.prompt_seconds, seed=options.seed, name="bench")
    )
    top = max(options.concurrency)
    config = engine_config_for(model, max_active=top, max_waiting=top)
    engine = AsyncEngine(Engine(model.lm, model.flow, model.hift, config), threads=threads)
    report = BenchReport(
        model_dir=str(model.model_dir.root),
        options=options,
        torch_threads=threads,
        cpu_count=os.cpu_count() or 1,
        plan=model.plan.labels(),
        kv_cache_dtype=str(config.dtype).removeprefix("torch."),
        load_average_before=os.getloadavg(),
    )
    engine.start()
    try:
        if options.warm_up:
            warm = _spec(model, voice, options, "warm-up", 0, min(options.tokens, WARM_UP_TOKENS))
            asyncio.run(_run_level(engine, [warm], 1, hp.sample_rate, None))
        for level, concurrency in enumerate(options.concurrency):
            specs = [
                _spec(model, voice, options, f"c{concurrency}-{i}", 1000 * (level + 1) + i, options.tokens)
                for i in range(options.rounds * concurrency)
            ]
            report.levels.append(_measure(engine, specs, concurrency, hp.sample_rate, on_request_done))
    finally:
        engine.shutdown()
    return report


def _spec(
    model: LoadedModel, voice: VoicePrompt, options: BenchOptions, request_id: str, index: int, tokens: int
) -> GenerationSpec:
    return synthetic_spec(
        request_id,
        voice,
        synthetic_text_ids(model.hparams, tokens, seed=options.seed + index),
        tokens=tokens,
        seed=options.seed + index,
        stream=options.stream,
        first_hop=options.first_hop,
    )


def _measure(
    engine: AsyncEngine,
    specs: list[GenerationSpec],
    concurrency: int,
    sample_rate: int,
    on_request_done: Callable[[int], None] | None,
) -> LevelResult:
    stats = engine.engine.stats
    prefix = engine.engine.prefix_cache
    before = stats.snapshot()
    reused_before = prefix.stats.reused_positions if prefix is not None else 0
    peak_reset = reset_peak_rss()
    device = torch.device(engine.engine.config.device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    done = (lambda: on_request_done(concurrency)) if on_request_done is not None else None
    start = time.perf_counter()
    timings = asyncio.run(_run_level(engine, specs, concurrency, sample_rate, done))
    wall = time.perf_counter() - start
    after = stats.snapshot()  # the engine is idle: every request has ended
    tokens = sum(t.tokens for t in timings)
    lm_busy = (after.prefill_s - before.prefill_s) + (after.decode_s - before.decode_s)
    return LevelResult(
        concurrency=concurrency,
        requests=len(timings),
        wall_s=wall,
        first_chunk_s=Percentiles.of([t.first_chunk_s for t in timings]),
        total_s=Percentiles.of([t.total_s for t in timings]),
        rtf=float(np.mean([t.total_s / t.audio_s for t in timings])),
        audio_s_per_s=sum(t.audio_s for t in timings) / wall,
        lm_tokens_per_s=tokens / wall,
        lm_busy_tokens_per_s=tokens / lm_busy if lm_busy > 0 else 0.0,
        peak_rss_mb=peak_rss_mb(),
        rss_peak_is_level=peak_reset,
        peak_device_mb=torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        prefix_reused_positions=(prefix.stats.reused_positions if prefix is not None else 0) - reused_before,
        prefill_positions=after.prefill_tokens - before.prefill_tokens,
        stage_s={
            stage: getattr(after, f"{stage}_s") - getattr(before, f"{stage}_s")
            for stage in ("prefill", "decode", "flow", "hift")
        },
        load_average=os.getloadavg(),
    )


async def _run_level(
    engine: AsyncEngine,
    specs: list[GenerationSpec],
    concurrency: int,
    sample_rate: int,
    on_done: Callable[[], None] | None,
) -> list[RequestTiming]:
    queue: asyncio.Queue[GenerationSpec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    timings: list[RequestTiming] = []

    async def worker() -> None:
        while not queue.empty():
            timings.append(await _one(engine, queue.get_nowait(), sample_rate))
            if on_done is not None:
                on_done()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings


async def _one(engine: AsyncEngine, spec: GenerationSpec, sample_rate: int) -> RequestTiming:
    start = time.perf_counter()
    first: float | None = None
    samples = tokens = 0
    async for chunk in engine.generate(spec):
        if first is None and chunk.audio.size:
            first = time.perf_counter() - start
        samples += int(chunk.audio.size)
        if chunk.speech_tokens is not None:
            tokens = len(chunk.speech_tokens)
    total = time.perf_counter() - start
    return RequestTiming(first if first is not None else total, total, samples / sample_rate, tokens)


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux); False if it refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM) in MiB, 0 where /proc is not there."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
