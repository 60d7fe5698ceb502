"""Prometheus metrics of one server process, in a registry of its own (no global state).

Request metrics are recorded by :class:`~cosyserve.server.http.request_context.RequestContextMiddleware`;
engine and process state is read at scrape time from the speech service
(:class:`_EngineCollector`), and memory growth is set by the
:class:`~cosyserve.server.observability.watchdog.MemoryWatchdog`. ``GET /metrics`` serves the text format.
"""

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from cosyserve.engine.stats import EngineStats
    from cosyserve.server.service import SpeechService

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text format."""
    server_metrics: ServerMetrics = request.app.state.metrics
    return Response(generate_latest(server_metrics.registry), media_type=CONTENT_TYPE_LATEST)


class ServerMetrics:
    """The metrics of one process. ``services`` returns the speech services built so far
    (one per model; none before a model is loaded), for the engine gauges read at scrape
    time: the unlabelled ones add up every model's engine (``cosyserve_engine_alive``: 1
    while all run), the ``cosyserve_model_*`` ones are per model."""

    def __init__(self, services: "Callable[[], Sequence[SpeechService]]" = lambda: ()) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "cosyserve_requests", "HTTP requests by route and status.", ["route", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "cosyserve_request_duration_seconds",
            "Whole HTTP request time, to the last byte.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_audio_seconds = Histogram(
            "cosyserve_time_to_first_audio_seconds",
            "From the request's arrival to its first audio.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rtf = Histogram(
            "cosyserve_real_time_factor",
            "Request time divided by the audio seconds produced (below 1: faster than real time).",
            ["route"],
            buckets=_RTF_BUCKETS,
            registry=r,
        )
        self.audio_seconds = Counter(
            "cosyserve_audio_seconds", "Seconds of audio produced.", ["route"], registry=r
        )
        self.model_requests = Counter(
            "cosyserve_model_requests",
            "Synthesis requests (HTTP) by model id, route and status.",
            ["model", "route", "status"],
            registry=r,
        )
        self.model_audio_seconds = Counter(
            "cosyserve_model_audio_seconds", "Seconds of audio produced, by model id.", ["model"], registry=r
        )
        self.memory_growth = Gauge(
            "cosyserve_memory_growth_bytes",
            "Growth over the memory watchdog's window of idle samples (rss, cuda_allocated).",
            ["kind"],
            registry=r,
        )
        self.memory_idle = Gauge(
            "cosyserve_memory_idle_bytes", "Latest memory sample taken while idle.", ["kind"], registry=r
        )
        self.plan = Info(
            "cosyserve_plan",
            "The speed plan this process runs (profile, device, precision, kernels; docs/performance.md).",
            registry=r,
        )
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds
        r.register(_EngineCollector(services))

    def observe_request(
        self,
        *,
        route: str,
        status: int,
        total_s: float,
        first_audio_s: float | None,
        audio_s: float,
        model: str | None = None,
    ) -> None:
        """``model``: the id of the model that synthesised (None: the request reached none)."""
        self.requests.labels(route, str(status)).inc()
        if model is not None:
            self.model_requests.labels(model, route, str(status)).inc()
            if audio_s > 0:
                self.model_audio_seconds.labels(model).inc(audio_s)
        self.request_seconds.labels(route).observe(total_s)
        if first_audio_s is not None:
            self.first_audio_seconds.labels(route).observe(first_audio_s)
        if audio_s > 0:
            self.audio_seconds.labels(route).inc(audio_s)
            self.rtf.labels(route).observe(total_s / audio_s)


class _EngineCollector(Collector):
    """Engine, queue and device gauges, read when scraped."""

    def __init__(self, services: "Callable[[], Sequence[SpeechService]]") -> None:
        self._services = services

    def collect(self) -> Iterator[Metric]:
        services = list(self._services())
        if services:
            engines = [service.engine for service in services]
            snapshots = [engine.engine.stats.snapshot() for engine in engines]

            def total(field: str) -> float:
                return float(sum(getattr(stats, field) for stats in snapshots))

            yield _gauge(
                "cosyserve_engine_alive",
                "1 while the engine thread runs (every model's).",
                float(all(engine.alive for engine in engines)),
            )
            yield _gauge(
                "cosyserve_requests_in_flight",
                "Requests admitted and not finished.",
                sum(service.in_flight for service in services),
            )
            yield _gauge(
                "cosyserve_active_streams",
                "Requests inside the engine.",
                sum(engine.active_requests for engine in engines),
            )
            yield _gauge(
                "cosyserve_queue_depth",
                "Requests waiting for a KV slot.",
                sum(len(engine.engine.scheduler.waiting) for engine in engines),
            )
            yield _gauge(
                "cosyserve_lm_batch_size",
                "Requests in the latest LM decode step.",
                max(stats.last_decode_batch for stats in snapshots),
            )
            decode_s = total("decode_s")
            tokens_per_s = total("decoded_tokens") / decode_s if decode_s else 0.0
            yield _gauge(
                "cosyserve_lm_tokens_per_second", "Decoded speech tokens per decode second.", tokens_per_s
            )
            yield _counter("cosyserve_lm_decoded_tokens", "Speech tokens decoded.", total("decoded_tokens"))
            yield _counter("cosyserve_lm_prefill_tokens", "Tokens prefilled.", total("prefill_tokens"))
            yield _counter("cosyserve_lm_decode_steps", "Batched LM decode steps.", total("decode_steps"))
            for stage in ("prefill", "decode", "flow", "hift"):
                yield _counter(
                    f"cosyserve_{stage}_seconds", f"Wall seconds spent in {stage}.", total(f"{stage}_s")
                )
            # token2wav batches chunks of several requests: calls and the chunks they carried.
            yield _counter("cosyserve_flow_calls", "Flow (token-to-mel) batched calls.", total("flow_calls"))
            yield _counter("cosyserve_flow_chunks", "Chunks through the flow.", total("flow_rows"))
            yield _counter("cosyserve_hift_calls", "HiFT (mel-to-wave) batched calls.", total("hift_calls"))
            yield _counter("cosyserve_hift_chunks", "Chunks through HiFT.", total("hift_rows"))
            yield _counter(
                "cosyserve_flow_cache_refusals",
                "Streamed segments recomputed per chunk: the flow stream cache budget was full.",
                total("flow_cache_refusals"),
            )
            errors = CounterMetricFamily(
                "cosyserve_engine_errors", "Requests the engine failed, by error code.", labels=["kind"]
            )
            failures: dict[str, int] = {}
            for stats in snapshots:
                for kind, count in stats.failures.items():
                    failures[kind] = failures.get(kind, 0) + count
            for kind, count in sorted(failures.items()):
                errors.add_metric([kind], count)
            yield errors
            yield from _per_model(services, snapshots)
        if torch.cuda.is_available():
            yield _gauge(
                "cosyserve_cuda_memory_allocated_bytes",
                "CUDA memory held by tensors.",
                torch.cuda.memory_allocated(),
            )
            yield _gauge(
                "cosyserve_cuda_memory_reserved_bytes",
                "CUDA memory reserved by the caching allocator.",
                torch.cuda.memory_reserved(),
            )


def _per_model(services: "Sequence[SpeechService]", snapshots: "list[EngineStats]") -> Iterator[Metric]:
    alive = GaugeMetricFamily(
        "cosyserve_model_engine_alive", "1 while the model's engine thread runs.", labels=["model"]
    )
    in_flight = GaugeMetricFamily(
        "cosyserve_model_requests_in_flight",
        "The model's requests admitted and not finished.",
        labels=["model"],
    )
    decoded = CounterMetricFamily(
        "cosyserve_model_lm_decoded_tokens", "Speech tokens the model decoded.", labels=["model"]
    )
    for service, stats in zip(services, snapshots, strict=True):
        alive.add_metric([service.model_id], float(service.engine.alive))
        in_flight.add_metric([service.model_id], service.in_flight)
        decoded.add_metric([service.model_id], stats.decoded_tokens)
    yield from (alive, in_flight, decoded)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
