"""Memory watchdog: samples RSS (and CUDA memory on a GPU) while the server is idle,
exports the growth over a window of samples, and warns about sustained growth.

Samples are taken between requests (when nothing is in flight), so that what a request
holds while it runs does not look like a leak; a window whose later half never drops
below its earlier half's peak, and that grew by ``warn_growth_bytes`` or more, is a
sustained trend.
"""

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cosyserve.server.observability.metrics import ServerMetrics

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024


@dataclass(frozen=True)
class MemorySample:
    """Bytes: resident set size, and CUDA memory held by tensors (None without a GPU)."""

    at: float
    rss: int
    cuda_allocated: int | None = None


@dataclass(frozen=True)
class WatchdogConfig:
    """Sample every ``interval_s`` seconds (when idle); judge a trend over ``window``
    samples; warn when it grew by ``warn_growth_bytes``."""

    interval_s: float = 30.0
    window: int = 10
    warn_growth_bytes: int = 512 * _MIB

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.window < 2 or self.warn_growth_bytes <= 0:
            raise ValueError("interval_s and warn_growth_bytes must be positive and window >= 2")


def read_rss_bytes() -> int:
    """This process's resident set size (Linux ``/proc``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def sample_memory() -> MemorySample:
    cuda = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
    return MemorySample(time.monotonic(), read_rss_bytes(), cuda)


class MemoryWatchdog:
    """Call :meth:`tick` (or run :meth:`run` as a task); ``idle`` says whether no request
    is in flight."""

    def __init__(
        self,
        config: WatchdogConfig,
        metrics: ServerMetrics,
        idle: Callable[[], bool],
        sample: Callable[[], MemorySample] = sample_memory,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._idle = idle
        self._sample = sample
        self.samples: deque[MemorySample] = deque(maxlen=config.window)
        # Growth already warned about: warn again only when it grows by another threshold.
        self._warned_rss = 0
        self._warned_cuda = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            self.tick()

    def tick(self) -> MemorySample | None:
        """Take a sample if idle; update the gauges; warn on a sustained trend."""
        if not self._idle():
            return None
        sample = self._sample()
        self.samples.append(sample)
        self.metrics.memory_idle.labels("rss").set(sample.rss)
        rss_growth = _growth([s.rss for s in self.samples])
        self.metrics.memory_growth.labels("rss").set(rss_growth)
        if sample.cuda_allocated is not None:
            self.metrics.memory_idle.labels("cuda_allocated").set(sample.cuda_allocated)
            cuda = [s.cuda_allocated or 0 for s in self.samples]
            self.metrics.memory_growth.labels("cuda_allocated").set(_growth(cuda))
        if len(self.samples) == self.config.window:
            self._warned_rss = self._check("RSS", [s.rss for s in self.samples], self._warned_rss)
            if sample.cuda_allocated is not None:
                cuda = [s.cuda_allocated or 0 for s in self.samples]
                self._warned_cuda = self._check("CUDA allocated memory", cuda, self._warned_cuda)
        return sample

    def _check(self, what: str, values: list[int], warned: int) -> int:
        """Warn about a sustained trend in ``values``; returns the growth warned about."""
        growth = values[-1] - values[0]
        half = len(values) // 2
        sustained = min(values[half:]) >= max(values[:half])
        if not sustained or growth < self.config.warn_growth_bytes:
            return 0
        if warned and growth < warned + self.config.warn_growth_bytes:
            return warned
        seconds = self.samples[-1].at - self.samples[0].at
        logger.warning(
            "memory keeps growing: %s went from %.1f MiB to %.1f MiB (+%.1f MiB) over %d idle "
            "samples in %.0f s; if it goes on, restart the process (SIGTERM drains it) and report it",
            what,
            values[0] / _MIB,
            values[-1] / _MIB,
            growth / _MIB,
            len(values),
            seconds,
            extra={"memory": what, "growth_bytes": growth},
        )
        return growth


def _growth(values: list[int]) -> int:
    return values[-1] - values[0] if values else 0
