"""Counters the engine keeps about its own work (read by metrics, benchmarks and the CLI).

The engine thread is the only writer; readers take a :meth:`EngineStats.snapshot`.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace


@dataclass
class EngineStats:
    """Cumulative wall seconds per stage and work counts since the engine started."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    flow_s: float = 0.0
    hift_s: float = 0.0
    prefill_tokens: int = 0
    decode_steps: int = 0
    decoded_tokens: int = 0
    flow_calls: int = 0  # batched flow passes
    flow_rows: int = 0  # chunks they computed (flow_rows / flow_calls: the mean batch)
    hift_calls: int = 0
    hift_rows: int = 0
    flow_cache_refusals: int = 0  # streamed segments the stream cache budget sent to recompute
    audio_samples: int = 0
    last_decode_batch: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # failed requests by error code

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to ``<stage>_s``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, f"{stage}_s", getattr(self, f"{stage}_s") + time.perf_counter() - start)

    def snapshot(self) -> "EngineStats":
        return replace(self, failures=dict(self.failures))
