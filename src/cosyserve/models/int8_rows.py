"""Streams' cached flow states held in int8: a quarter of float32's memory.

A stream's flow caches (CosyVoice 2's estimator inputs, CosyVoice 3's DiT keys and values)
grow with every frame and, with several streams, hold most of a process's memory. Each
cached vector (one position of one head, or one position's layer input) is held as int8
with its own float32 scale, ``absmax / 127``: symmetric, per row, so one loud position
costs no precision elsewhere. Reads convert back to the dtype the flow computes in. The
error this adds to a stream's audio is in ``docs/precision.md``.

Memory per vector of ``d`` values: ``d + 4`` bytes (float32: ``4 d``; float16: ``2 d``).
"""

import torch
from torch import Tensor

_LEVELS = 127  # symmetric: -127..127, so the scale maps absmax exactly
_TINY = torch.finfo(torch.float32).tiny  # the scale of an all-zero row (any positive value)


def row_bytes(width: int, dtype: torch.dtype) -> int:
    """Bytes one cached vector of ``width`` values takes held in ``dtype`` (``torch.int8``:
    with its scale)."""
    if dtype == torch.int8:
        return width + torch.float32.itemsize
    return width * dtype.itemsize


class Int8Rows:
    """``(B, H, capacity, d)`` values held as int8 with one float32 scale per ``d``-vector:
    ``data`` ``(B, H, capacity, d)`` int8 and ``scale`` ``(B, H, capacity, 1)``. Only
    positions written are meaningful; :meth:`head` views the first ones."""

    def __init__(self, data: Tensor, scale: Tensor) -> None:
        self.data = data
        self.scale = scale

    @classmethod
    def empty(cls, shape: tuple[int, int, int, int], device: torch.device) -> "Int8Rows":
        data = torch.empty(shape, dtype=torch.int8, device=device)
        scale = torch.empty(*shape[:3], 1, dtype=torch.float32, device=device)
        return cls(data, scale)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def write(self, start: int, new: Tensor) -> None:
        """Hold ``new`` ``(B, H, n, d)`` (any float dtype) at positions ``start..start+n``."""
        end = start + new.shape[2]
        values = new.float()
        scale = values.abs().amax(dim=-1, keepdim=True).div_(_LEVELS).clamp_(min=_TINY)
        self.scale[:, :, start:end] = scale
        self.data[:, :, start:end] = torch.div(values, scale).round_()

    def head(self, end: int) -> "Int8Rows":
        """The first ``end`` positions, as views (no copy)."""
        return Int8Rows(self.data[:, :, :end], self.scale[:, :, :end])

    def copy_head(self, source: "Int8Rows", end: int) -> None:
        """Take ``source``'s first ``end`` positions as they are held (a grown buffer)."""
        self.data[:, :, :end] = source.data[:, :, :end]
        self.scale[:, :, :end] = source.scale[:, :, :end]

    def clone(self) -> "Int8Rows":
        return Int8Rows(self.data.clone(), self.scale.clone())

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """All positions ``(B, H, capacity, d)`` in ``dtype``."""
        out = torch.empty(self.shape, dtype=dtype, device=self.data.device)
        self.dequantize_into(out)
        return out

    def dequantize_into(self, out: Tensor) -> None:
        """Write all positions into ``out`` (same shape, any float dtype; a view is fine)."""
        out.copy_(self.data)
        out.mul_(self.scale)

    def tensors(self) -> tuple[Tensor, Tensor]:
        return self.data, self.scale


Held = Tensor | Int8Rows  # cached positions ``(B, H, n, d)`` as held: a tensor or int8 rows


def new_held(shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> Held:
    """An uninitialised buffer of ``shape`` holding ``dtype`` (``torch.int8``: int8 rows)."""
    if dtype == torch.int8:
        return Int8Rows.empty(shape, device)
    return torch.empty(shape, dtype=dtype, device=device)


def write_held(buffer: Held, start: int, new: Tensor) -> None:
    """``new`` ``(B, H, n, d)`` into ``buffer`` at positions ``start..start+n``."""
    if isinstance(buffer, Int8Rows):
        buffer.write(start, new)
    else:
        buffer[:, :, start : start + new.shape[2]] = new


def head(buffer: Held, end: int) -> Held:
    """``buffer``'s first ``end`` positions, as views."""
    return buffer.head(end) if isinstance(buffer, Int8Rows) else buffer[:, :, :end]


def copy_head(target: Held, source: Held, end: int) -> None:
    """``source``'s first ``end`` positions into ``target`` (held alike: a grown buffer)."""
    if isinstance(target, Int8Rows) and isinstance(source, Int8Rows):
        target.copy_head(source, end)
    elif isinstance(target, Tensor) and isinstance(source, Tensor):
        target[:, :, :end] = source[:, :, :end]
    else:
        raise TypeError("a grown buffer holds its positions as the old one did")


def read_into(out: Tensor, held: Held) -> None:
    """All of ``held``'s positions into ``out`` (same shape, ``out``'s dtype)."""
    if isinstance(held, Int8Rows):
        held.dequantize_into(out)
    else:
        out.copy_(held)


def as_dtype(held: Held, dtype: torch.dtype) -> Tensor:
    """All of ``held``'s positions in ``dtype`` (no copy for a tensor already in it)."""
    return held.dequantized(dtype) if isinstance(held, Int8Rows) else held.to(dtype)


def held_tensors(held: Held) -> tuple[Tensor, ...]:
    """The tensors that hold ``held``'s memory."""
    return held.tensors() if isinstance(held, Int8Rows) else (held,)
