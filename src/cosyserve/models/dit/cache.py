"""What one Euler step of an incremental stream keeps of the frames already computed.

With chunk-causal attention, the causal positional convolution and fixed noise, a frame's
state at every Euler step depends on earlier frames and the frames of its own attention
chunk only. Once a chunk is complete its frames never change again, so a stream keeps, per
Euler step and for both classifier-free-guidance rows: each layer's attention keys and
values of those frames, and the last inputs of the two positional convolutions. A call
then runs the DiT on the frames after them only.

A call writes every frame it computes after the cached ones (pending); the stream then
keeps those up to the last complete chunk (:meth:`StepCache.commit`), and the next call
overwrites the rest. Keys and values live in buffers that grow by doubling, so a call
neither copies the cache nor concatenates to it.

A voice prompt's primed frames (:mod:`cosyserve.models.dit.prompt_cache`) are a cache
trimmed to its frames (:meth:`StepCache.trimmed`), which each new stream of the voice
copies into buffers of its own (:meth:`StepCache.fork`).

Memory: ``2 rows x 2 (k, v) x heads x head_dim`` values per frame, layer and Euler step:
3.6 MB per frame in float32 for the released model (22 layers, 10 steps, width 1024).
"""

import torch
from torch import Tensor

MIN_CAPACITY = 256  # frames


class StepCache:
    """Cached frames of one Euler step. Keys/values are ``(R, H, capacity, d)`` buffers per
    layer (``R`` = 2 guidance rows), the first ``length`` frames valid; convolution tails
    are ``(R, D, kernel - 1)``, zeros before the first frame as the causal convolutions
    pad."""

    def __init__(self, depth: int, capacity: int = MIN_CAPACITY) -> None:
        """``capacity``: frames the buffers are first made for (more grow them)."""
        self.length = 0
        self.capacity = max(MIN_CAPACITY, capacity)
        self.keys: list[Tensor | None] = [None] * depth
        self.values: list[Tensor | None] = [None] * depth
        self.tails: dict[str, Tensor] = {}
        self._pending_tails: dict[str, tuple[Tensor, int]] = {}

    def attend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keys/values ``(R, H, T, d)`` of the new frames -> views of those of the cached
        frames followed by them, ``(R, H, length + T, d)``. The new ones are pending."""
        end = self.length + k.shape[2]
        keys = self._room(self.keys[layer], k, end)
        values = self._room(self.values[layer], v, end)
        keys[:, :, self.length : end] = k
        values[:, :, self.length : end] = v
        self.keys[layer], self.values[layer] = keys, values
        return keys[:, :, :end], values[:, :, :end]

    def _room(self, buffer: Tensor | None, new: Tensor, end: int) -> Tensor:
        """``buffer``, or a copy of its valid frames in one at least twice as long, holding
        ``end`` frames."""
        if buffer is not None and buffer.shape[2] >= end:
            return buffer
        capacity = max(self.capacity, end, 0 if buffer is None else 2 * buffer.shape[2])
        grown = new.new_empty(new.shape[0], new.shape[1], capacity, new.shape[3])
        if buffer is not None:
            grown[:, :, : self.length] = buffer[:, :, : self.length]
        return grown

    def left_pad(self, name: str, x: Tensor, width: int) -> Tensor:
        """``x`` ``(R, D, T)`` preceded by the ``width`` cached inputs of convolution
        ``name``: ``(R, D, width + T)``. It is pending."""
        tail = self.tails.get(name)
        if tail is None:
            tail = x.new_zeros(x.shape[0], x.shape[1], width)
        padded = torch.cat([tail, x], dim=2)
        self._pending_tails[name] = (padded, width)
        return padded

    def commit(self, frames: int) -> None:
        """Keep the first ``frames`` pending frames of the last call, drop the rest."""
        for name, (padded, width) in self._pending_tails.items():
            # Padded index ``width + j`` is new frame ``j``: the ``width`` inputs before
            # frame ``frames`` start at padded index ``frames``.
            self.tails[name] = padded[:, :, frames : frames + width].clone()
        self.length += frames
        self._pending_tails.clear()

    def trimmed(self) -> "StepCache":
        """A copy holding only the committed frames, in buffers exactly that long (a primed
        prompt kept for later streams; it takes no pending work)."""
        if self._pending_tails:
            raise RuntimeError("a step cache with pending frames cannot be trimmed")
        out = StepCache(len(self.keys))
        out.length = out.capacity = self.length
        out.keys = [None if k is None else k[:, :, : self.length].clone() for k in self.keys]
        out.values = [None if v is None else v[:, :, : self.length].clone() for v in self.values]
        out.tails = dict(self.tails)  # replaced, never written in place: shared safely
        return out

    def fork(self, capacity: int = MIN_CAPACITY) -> "StepCache":
        """A new cache starting from this one's committed frames, copied into its own
        buffers of ``capacity`` frames (at least these and :data:`MIN_CAPACITY`)."""
        if self._pending_tails:
            raise RuntimeError("a step cache with pending frames cannot be forked")
        out = StepCache(len(self.keys), max(capacity, self.length))
        out.length = self.length
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k is None or v is None:
                continue
            out.keys[layer] = _copy_into(k, self.length, out.capacity)
            out.values[layer] = _copy_into(v, self.length, out.capacity)
        out.tails = dict(self.tails)
        return out

    def nbytes(self) -> int:
        """Memory of the buffers and convolution tails."""
        buffers = [t for t in self.keys + self.values if t is not None] + list(self.tails.values())
        return sum(t.numel() * t.element_size() for t in buffers)


def _copy_into(buffer: Tensor, length: int, capacity: int) -> Tensor:
    """A ``(R, H, capacity, d)`` buffer whose first ``length`` frames are ``buffer``'s."""
    out = buffer.new_empty(buffer.shape[0], buffer.shape[1], capacity, buffer.shape[3])
    out[:, :, :length] = buffer[:, :, :length]
    return out
