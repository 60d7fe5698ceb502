"""The memory watchdog: idle sampling, growth metric, warning on sustained growth."""

import logging

import pytest

from cosyserve.server.observability.metrics import ServerMetrics
from cosyserve.server.observability.watchdog import (
    MemorySample,
    MemoryWatchdog,
    WatchdogConfig,
    read_rss_bytes,
)

MIB = 1024 * 1024


def _watchdog(rss_mib: list[int], idle: list[bool] | None = None) -> tuple[MemoryWatchdog, ServerMetrics]:
    samples = iter(rss_mib)
    ticks = iter(range(10_000))
    idles = iter(idle) if idle is not None else None
    metrics = ServerMetrics()
    watchdog = MemoryWatchdog(
        WatchdogConfig(interval_s=10, window=4, warn_growth_bytes=100 * MIB),
        metrics,
        idle=lambda: True if idles is None else next(idles),
        sample=lambda: MemorySample(at=10.0 * next(ticks), rss=next(samples) * MIB),
    )
    return watchdog, metrics


def _growth(metrics: ServerMetrics) -> float:
    return float(metrics.registry.get_sample_value("cosyserve_memory_growth_bytes", {"kind": "rss"}) or 0)


def test_sustained_growth_is_exported_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    watchdog, metrics = _watchdog([500, 560, 620, 680, 690, 700])
    with caplog.at_level(logging.WARNING, "cosyserve.server.observability.watchdog"):
        for _ in range(6):
            watchdog.tick()
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "memory keeps growing: RSS went from 500.0 MiB to 680.0 MiB (+180.0 MiB) over 4 idle samples "
        "in 30 s; if it goes on, restart the process (SIGTERM drains it) and report it"
    ]
    assert _growth(metrics) == (700 - 620) * MIB
    assert metrics.registry.get_sample_value("cosyserve_memory_idle_bytes", {"kind": "rss"}) == 700 * MIB


def test_a_spike_that_comes_back_down_is_not_a_trend(caplog: pytest.LogCaptureFixture) -> None:
    watchdog, _ = _watchdog([500, 900, 510, 640])
    with caplog.at_level(logging.WARNING, "cosyserve.server.observability.watchdog"):
        for _ in range(4):
            watchdog.tick()
    assert not caplog.records


def test_samples_are_taken_only_between_requests() -> None:
    watchdog, metrics = _watchdog([500, 600], idle=[False, True, False, True])
    assert [watchdog.tick() is not None for _ in range(4)] == [False, True, False, True]
    assert _growth(metrics) == 100 * MIB


def test_rss_is_read_from_the_process() -> None:
    assert read_rss_bytes() > 10 * MIB
