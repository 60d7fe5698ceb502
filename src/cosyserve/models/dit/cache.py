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
trimmed to its frames (:meth:`StepCache.trimmed`). Each new stream of the voice reads
them, shared and never written, before its own frames (:meth:`StepCache.fork`).

Memory: ``2 rows x 2 (k, v) x heads x head_dim`` values per frame, layer and Euler step:
3.6 MB per frame in float32 for the released model (22 layers, 10 steps, width 1024).
A cache may hold them in a narrower ``dtype`` than the DiT computes in (float16: half a
float32 flow's memory; ``torch.int8``: :class:`~cosyserve.models.int8_rows.Int8Rows`, about
a quarter); attention then reads the cached frames converted back, the new frames as
computed.
"""

from typing import Protocol

import torch
from torch import Tensor

from cosyserve.models.int8_rows import Held, copy_head, head, held_tensors, new_held, read_into, write_held

MIN_CAPACITY = 256  # frames


class FrameCache(Protocol):
    """What the DiT reads and writes of the frames before a call's: one stream's
    :class:`StepCache`, or several streams' as one
    (:class:`~cosyserve.models.dit.stacked.StackedStepCache`)."""

    length: int

    def attend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...

    def left_pad(self, name: str, x: Tensor, width: int) -> Tensor: ...


class StepCache:
    """Cached frames of one Euler step. The first ``shared`` of the ``length`` valid frames
    are a primed prompt's (``(R, H, shared, d)`` per layer, ``R`` = 2 guidance rows, read
    only); the frames after them live in ``(R, H, capacity, d)`` buffers of its own.
    Convolution tails are ``(R, D, kernel - 1)``, zeros before the first frame as the
    causal convolutions pad."""

    def __init__(self, depth: int, capacity: int = MIN_CAPACITY, dtype: torch.dtype | None = None) -> None:
        """``capacity``: frames of its own the buffers are first made for (more grow them);
        ``dtype``: what keys and values are held in (None: as computed; ``torch.int8``:
        int8 rows with their scales)."""
        self.length = 0
        self.shared = 0
        self.capacity = max(MIN_CAPACITY, capacity)
        self.dtype = dtype
        self.keys: list[Held | None] = [None] * depth
        self.values: list[Held | None] = [None] * depth
        self.shared_keys: list[Held | None] = [None] * depth
        self.shared_values: list[Held | None] = [None] * depth
        self.tails: dict[str, Tensor] = {}
        self._pending_tails: dict[str, tuple[Tensor, int]] = {}

    def attend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keys/values ``(R, H, T, d)`` of the new frames -> those of the cached frames
        followed by them, ``(R, H, length + T, d)`` in ``k``'s dtype: views of the buffers
        where they hold every frame as computed, else a copy. The new ones are pending."""
        keys = self._write(self.keys, layer, k)
        values = self._write(self.values, layer, v)
        if (
            not self.shared
            and isinstance(keys, Tensor)
            and isinstance(values, Tensor)
            and keys.dtype == k.dtype
        ):
            end = self.length + k.shape[2]
            return keys[:, :, :end], values[:, :, :end]
        return self._read(self.shared_keys[layer], keys, k), self._read(self.shared_values[layer], values, v)

    def _write(self, buffers: list[Held | None], layer: int, new: Tensor) -> Held:
        """``layer``'s own buffer with ``new`` written after the cached frames."""
        start = self.length - self.shared
        end = start + new.shape[2]
        buffer = buffers[layer]
        if buffer is None or buffer.shape[2] < end:
            buffer = self._grown(buffer, new, end)
        write_held(buffer, start, new)
        buffers[layer] = buffer
        return buffer

    def _grown(self, buffer: Held | None, new: Tensor, end: int) -> Held:
        """A buffer at least twice as long as ``buffer`` holding ``end`` own frames, with
        ``buffer``'s valid frames copied in."""
        capacity = max(self.capacity, end, 0 if buffer is None else 2 * buffer.shape[2])
        shape = (new.shape[0], new.shape[1], capacity, new.shape[3])
        grown = new_held(shape, self.dtype or new.dtype, new.device)
        if buffer is not None:
            copy_head(grown, buffer, self.length - self.shared)
        return grown

    def _read(self, shared: Held | None, own: Held, new: Tensor) -> Tensor:
        """The shared frames, the own cached ones and ``new``, in ``new``'s dtype."""
        out = new.new_empty(new.shape[0], new.shape[1], self.length + new.shape[2], new.shape[3])
        if shared is not None:
            read_into(out[:, :, : self.shared], shared)
        read_into(out[:, :, self.shared : self.length], head(own, self.length - self.shared))
        out[:, :, self.length :] = new
        return out

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
        self._check_own("trimmed")
        out = StepCache(len(self.keys), dtype=self.dtype)
        out.length = out.capacity = self.length
        out.keys = [None if k is None else head(k, self.length).clone() for k in self.keys]
        out.values = [None if v is None else head(v, self.length).clone() for v in self.values]
        out.tails = dict(self.tails)  # replaced, never written in place: shared safely
        return out

    def fork(self, capacity: int = MIN_CAPACITY, dtype: torch.dtype | None = None) -> "StepCache":
        """A new cache continuing from this one's committed frames, which it reads shared
        (neither cache writes them); its own frames go into buffers first made for
        ``capacity`` frames in all (these included), held in ``dtype`` (None: as computed)."""
        self._check_own("forked")
        out = StepCache(len(self.keys), capacity - self.length, dtype)
        out.length = out.shared = self.length
        out.shared_keys = [None if k is None else head(k, self.length) for k in self.keys]
        out.shared_values = [None if v is None else head(v, self.length) for v in self.values]
        out.tails = dict(self.tails)
        return out

    def _check_own(self, what: str) -> None:
        if self._pending_tails:
            raise RuntimeError(f"a step cache with pending frames cannot be {what}")
        if self.shared:
            raise RuntimeError(f"a step cache reading shared frames cannot be {what}")

    def nbytes(self) -> int:
        """Memory of its own buffers and convolution tails (shared frames are their owner's)."""
        held = [t for buffer in self.keys + self.values if buffer is not None for t in held_tensors(buffer)]
        return sum(t.numel() * t.element_size() for t in held + list(self.tails.values()))
