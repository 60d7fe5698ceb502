"""Several streams' step caches as one, so that their chunks go through the DiT in one pass.

Every matrix product of the DiT then runs over all the streams' frames at once (on a CPU a
chunk of 50 frames x 2 guidance rows is too few rows to reach the GEMM's speed), while
each stream's keys, values and convolution inputs stay its own. The streams must hold
equally many cached frames (streams in lockstep): then they share rotary angles and the
attention mask, and their keys line up for one attention call.

Rows are stream-major: stream ``b``'s conditional and unconditional rows are ``2b`` and
``2b + 1`` (:class:`~cosyserve.models.dit.cfm.DiTCFM` lays them out so).
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from cosyserve.models.dit.cache import StepCache

ROWS = 2  # guidance rows per stream


class StackedStepCache:
    """One Euler step's caches of several streams, read and written as a batch."""

    def __init__(self, caches: Sequence[StepCache]) -> None:
        if len({cache.length for cache in caches}) != 1:
            raise ValueError("stacked streams must hold the same number of cached frames")
        self.caches = list(caches)
        self.length = caches[0].length

    def attend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """As :meth:`StepCache.attend`, each stream's rows with its own cache:
        ``(2S, H, T, d)`` -> ``(2S, H, length + T, d)``."""
        parts = [cache.attend(layer, *self._rows(b, k, v)) for b, cache in enumerate(self.caches)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def left_pad(self, name: str, x: Tensor, width: int) -> Tensor:
        """As :meth:`StepCache.left_pad`, each stream's rows with its own cached inputs."""
        padded = [cache.left_pad(name, self._rows(b, x)[0], width) for b, cache in enumerate(self.caches)]
        return torch.cat(padded)

    @staticmethod
    def _rows(stream: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        return tuple(t[ROWS * stream : ROWS * (stream + 1)] for t in tensors)
