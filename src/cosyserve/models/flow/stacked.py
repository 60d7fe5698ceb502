"""The stream caches of several rows seen as one cache, for one batched incremental pass.

Each row keeps its own :class:`~cosyserve.models.flow.stream_cache.FlowStreamCache`
(one per streamed segment); a batched pass writes every row's new keys, values and
convolution contexts into that row's own states and attends over the rows' cached
positions stacked together. The rows must hold the same number of cached positions.
"""

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from cosyserve.models.flow.stream_cache import FlowStreamCache, LayerStates


class StackedStates(LayerStates):
    """One pass's states of ``len(rows)`` rows, the batch laid out as ``groups`` blocks of
    rows (the estimator runs the conditional and the unconditional CFG branch of every
    row as one batch: ``groups = 2``, row ``b`` at ``b`` and ``B + b``).

    Each row's ``keep`` is its own (set by its cache's ``begin``); this object holds nothing
    itself and is dropped after the pass.
    """

    def __init__(self, rows: Sequence[LayerStates], groups: int) -> None:
        super().__init__()
        if len({row.length for row in rows}) != 1:
            raise ValueError("stacked rows must hold the same number of cached positions")
        self.length = rows[0].length
        self.rows = rows
        self.groups = groups

    def attend(
        self, layer: nn.Module, k: Tensor, v: Tensor, inputs: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        parts = [
            row.attend_parts(layer, self._row(k, b), self._row(v, b), self._row_or_none(inputs, b))
            for b, row in enumerate(self.rows)
        ]
        return self._stack_parts([p[0] for p in parts]), self._stack_parts([p[1] for p in parts])

    def store(self, layer: nn.Module, k: Tensor, v: Tensor, inputs: Tensor | None = None) -> None:
        for b, row in enumerate(self.rows):
            row.store(layer, self._row(k, b), self._row(v, b), self._row_or_none(inputs, b))

    def cached(self, layer: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
        keys, values = zip(*(row.cached(layer) for row in self.rows), strict=True)
        if not keys[0]:  # the first pass: nothing cached
            return [], []
        return [self._stack_parts(list(keys))], [self._stack_parts(list(values))]

    def left_pad(self, conv: nn.Module, x: Tensor, width: int) -> Tensor:
        return self._stack([row.left_pad(conv, self._row(x, b), width) for b, row in enumerate(self.rows)])

    def context(self, conv: nn.Module, batch: int, channels: int, width: int, like: Tensor) -> Tensor:
        return self._stack([row.context(conv, self.groups, channels, width, like) for row in self.rows])

    def store_context(self, conv: nn.Module, padded: Tensor, width: int) -> None:
        for b, row in enumerate(self.rows):
            row.store_context(conv, self._row(padded, b), width)

    def _row(self, t: Tensor, b: int) -> Tensor:
        """Row ``b``'s part ``(groups, ...)`` of a batch tensor ``(groups * B, ...)``."""
        return t.view(self.groups, len(self.rows), *t.shape[1:])[:, b]

    def _row_or_none(self, t: Tensor | None, b: int) -> Tensor | None:
        return None if t is None else self._row(t, b)

    @staticmethod
    def _stack(parts: list[Tensor]) -> Tensor:
        """Rows' ``(groups, ...)`` tensors -> ``(groups * B, ...)`` in batch order."""
        return torch.stack(parts, dim=1).flatten(0, 1)

    @staticmethod
    def _stack_parts(rows: list[list[Tensor]]) -> Tensor:
        """Rows' position pieces ``(groups, H, n_i, d)`` (each row's adding up to the same
        length) -> ``(groups * B, H, length, d)`` in batch order, in one copy."""
        first = rows[0][0]
        length = sum(part.shape[2] for part in rows[0])
        out = first.new_empty(first.shape[0], len(rows), first.shape[1], length, first.shape[3])
        for b, parts in enumerate(rows):
            start = 0
            for part in parts:
                out[:, b, :, start : start + part.shape[2]] = part
                start += part.shape[2]
        return out.flatten(0, 1)


class StackedCache(FlowStreamCache):
    """The encoder and Euler-step states of several rows' caches for one pass (see
    :func:`cosyserve.models.flow.rows.stream_rows`). The caller begins and finishes the
    pass on each row's own cache."""

    def __init__(self, caches: Sequence[FlowStreamCache]) -> None:
        super().__init__(0)
        self.tokens = caches[0].tokens
        self.encoder_tokens = StackedStates([c.encoder_tokens for c in caches], 1)
        self.encoder_frames = StackedStates([c.encoder_frames for c in caches], 1)
        steps = len(caches[0].steps)
        self.steps = [StackedStates([c.steps[i] for c in caches], 2) for i in range(steps)]
