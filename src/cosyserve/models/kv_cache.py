"""A preallocated key/value cache holding many sequences at once, one per slot.

Each slot holds one request's keys and values for every layer and knows its own
length, so a decode step can advance sequences of different lengths together
(continuous batching). The model never keeps per-request state: everything that
belongs to a request lives in its slot here, and the slot number lives with the request.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch

from cosyserve.errors import CosyserveError, InvalidRequestError
from cosyserve.memory import lazy_zeros
from cosyserve.modeldir.hparams import Qwen2Config
from cosyserve.models.span_attention import padded_span


class CacheFullError(CosyserveError):
    """Every slot of the KV cache is taken; the request must wait or be refused."""

    code = "overloaded"


class SequenceTooLongError(InvalidRequestError):
    """A sequence would grow past the cache's ``max_len`` positions."""

    code = "sequence_too_long"


class KVStep(Protocol):
    """What the decoder layers need of a step: where the new tokens sit, what they may
    see, and a cache to write their keys and values into (:class:`CacheStep`, or the
    static decode step replayed from CUDA graphs, ``cosyserve.engine.decode_graphs``)."""

    @property
    def positions(self) -> torch.Tensor:
        """(B, T) long: the absolute position of each new token."""
        ...

    @property
    def decode(self) -> bool:
        """True for a decode step (each row appends the token it sampled last), False for
        a prefill chunk: the two sum attention's key blocks in another order
        (:func:`~cosyserve.models.span_attention.span_attention`)."""
        ...

    @property
    def mask(self) -> torch.Tensor:
        """(B, 1, T, S) bool, True where a new token may attend to key ``s``."""
        ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``layer``'s new keys and values (B, T, H_kv, D); return the history
        (B, H_kv, S, D), S a whole number of the attention's key blocks."""
        ...


def causal_mask(positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, S) bool, one mask for every head: True where the new token at
    ``positions`` (B, T) may attend to the key at cache position ``keys`` (S,), i.e. at
    or before its own position in its own sequence."""
    visible = keys[None, None, :] <= positions[:, :, None]  # (B, T, S)
    return visible[:, None]


@dataclass(frozen=True)
class CacheStep:
    """One forward step in which each of B slots appends the same number T of positions.

    A decode step (``decode``) is B sequences with T = 1; a prefill (or prefill chunk) is
    one sequence with T positions continuing whatever that slot already holds.
    ``positions``: (B, T) long, the absolute position of each new token. ``span``: S, the
    longest length of the batch after the step padded to whole key blocks
    (:func:`~cosyserve.models.span_attention.padded_span`).
    """

    cache: "KVCache"
    slots: tuple[int, ...]
    starts: tuple[int, ...]
    num_new: int
    slot_index: torch.Tensor
    positions: torch.Tensor
    span: int
    decode: bool

    @cached_property
    def mask(self) -> torch.Tensor:
        """(B, 1, T, S) bool, True where a new token may attend to cache position ``s < S``.
        Built when first read: a step replayed from a captured graph computes its own."""
        return causal_mask(self.positions, torch.arange(self.span, device=self.positions.device))

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values of ``layer``, return the whole visible history.

        ``k``, ``v``: (B, T, H_kv, D). Returns keys and values (B, H_kv, S, D).
        """
        cache_k, cache_v = self.cache.k[layer], self.cache.v[layer]  # (slots, H_kv, capacity, D)
        if len(self.slots) == 1:
            # Slices, not index tensors: a copy into the slot, and a view of its history.
            slot, start = self.slots[0], self.starts[0]
            cache_k[slot, :, start : start + self.num_new] = k[0].transpose(0, 1)
            cache_v[slot, :, start : start + self.num_new] = v[0].transpose(0, 1)
            rows = slice(slot, slot + 1)
            return cache_k[rows, :, : self.span], cache_v[rows, :, : self.span]
        index = self.slot_index[:, None]  # (B, 1), broadcast against positions (B, T)
        # Indices on dims 0 and 2 address (B, T, H_kv, D): the new keys as they come.
        cache_k[index, :, self.positions] = k.to(cache_k.dtype)
        cache_v[index, :, self.positions] = v.to(cache_v.dtype)
        return cache_k[self.slot_index, :, : self.span], cache_v[self.slot_index, :, : self.span]


class KVCache:
    """Keys and values of ``max_slots`` sequences of up to ``max_len`` positions each.

    ``k``, ``v``: (layers, max_slots, H_kv, capacity, D), allocated once: each head's
    positions in a row, so that a step's keys reach the attention's GEMMs without a
    transposing copy. ``capacity`` is ``max_len`` padded to whole key blocks: a step reads
    whole blocks, the positions past a sequence hidden by its mask. Slots are handed out
    by :meth:`allocate` and returned by :meth:`free`; a step is prepared with
    :meth:`begin`, run through the model (which calls :meth:`CacheStep.update` per layer)
    and made permanent with :meth:`commit`.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if min(num_layers, num_kv_heads, head_dim, max_slots, max_len) < 1:
            raise ValueError("KVCache dimensions must all be positive")
        self.capacity = padded_span(max_len)
        shape = (num_layers, max_slots, num_kv_heads, self.capacity, head_dim)
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        self.max_slots = max_slots
        self.max_len = max_len
        self._lengths = [0] * max_slots
        # Positions ever written per slot (also by steps never committed), zeroed by free().
        self._written = [0] * max_slots
        self._in_use = [False] * max_slots

    @classmethod
    def for_config(
        cls,
        cfg: Qwen2Config,
        max_slots: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> "KVCache":
        """A cache shaped for the Qwen2 backbone ``cfg``."""
        return cls(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_slots, max_len, dtype, device
        )

    @property
    def free_slots(self) -> int:
        return self._in_use.count(False)

    def allocate(self) -> int:
        """Take the lowest free slot, empty. Raises :class:`CacheFullError` when none is left."""
        for slot, used in enumerate(self._in_use):
            if not used:
                self._in_use[slot] = True
                return slot
        raise CacheFullError(f"KV cache is full: all {self.max_slots} slots are in use")

    def free(self, slot: int) -> None:
        """Return ``slot``. Its written positions are zeroed: a later occupant's masked-out
        positions are still multiplied by zero attention weights, which must not meet a
        stale inf or NaN."""
        self._check_slot(slot)
        written = self._written[slot]
        self.k[:, slot, :, :written] = 0
        self.v[:, slot, :, :written] = 0
        self._lengths[slot] = self._written[slot] = 0
        self._in_use[slot] = False

    def length(self, slot: int) -> int:
        """Positions ``slot`` holds."""
        self._check_slot(slot)
        return self._lengths[slot]

    def truncate(self, slot: int, length: int) -> None:
        """Drop the positions of ``slot`` from ``length`` on (to undo a step whose outputs
        were lost); later steps overwrite them."""
        self._check_slot(slot)
        if not 0 <= length <= self._lengths[slot]:
            raise ValueError(f"slot {slot} holds {self._lengths[slot]} positions, cannot keep {length}")
        self._lengths[slot] = length

    def read(self, slot: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the keys and values of positions ``[start, stop)`` that ``slot`` holds,
        each (layers, stop - start, H_kv, D); copy them before the slot is freed."""
        self._check_slot(slot)
        if not 0 <= start <= stop <= self._lengths[slot]:
            raise ValueError(f"positions [{start}, {stop}) are not all held by slot {slot}")
        return self.k[:, slot, :, start:stop].transpose(1, 2), self.v[:, slot, :, start:stop].transpose(1, 2)

    def load_prefix(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fill the empty ``slot`` with ``k``, ``v`` (layers, P, H_kv, D), keys and values
        computed earlier for the same first P positions; the slot then holds P positions."""
        self._check_slot(slot)
        if self._lengths[slot] != 0:
            raise ValueError(f"slot {slot} is not empty")
        n = k.shape[1]
        layers, _, heads, _, head_dim = self.k.shape
        if k.shape != v.shape or k.shape[0] != layers or k.shape[2:] != (heads, head_dim):
            raise ValueError(f"prefix keys {tuple(k.shape)} and values {tuple(v.shape)} do not fit the cache")
        if n > self.max_len:
            raise SequenceTooLongError(f"a prefix of {n} positions exceeds the KV cache's {self.max_len}")
        self.k[:, slot, :, :n] = k.transpose(1, 2)
        self.v[:, slot, :, :n] = v.transpose(1, 2)
        self._lengths[slot] = n
        self._written[slot] = max(self._written[slot], n)

    def begin(self, slots: Sequence[int], num_new: int, *, decode: bool = False) -> CacheStep:
        """Prepare a step in which every slot of ``slots`` appends ``num_new`` positions
        (one each for a ``decode`` step).

        Raises :class:`SequenceTooLongError` if a slot would exceed ``max_len``. The
        sequences' lengths change only at :meth:`commit`.
        """
        if not slots or num_new < 1:
            raise ValueError("a cache step needs at least one slot and one new position")
        if decode and num_new != 1:
            raise ValueError("a decode step appends one position per slot")
        if len(set(slots)) != len(slots):
            raise ValueError(f"a slot appears twice in one step: {list(slots)}")
        starts = []
        for slot in slots:
            self._check_slot(slot)
            start = self._lengths[slot]
            if start + num_new > self.max_len:
                raise SequenceTooLongError(
                    f"sequence in slot {slot} would reach {start + num_new} positions; "
                    f"the KV cache holds at most {self.max_len}"
                )
            starts.append(start)
        for slot, start in zip(slots, starts, strict=True):
            self._written[slot] = max(self._written[slot], start + num_new)
        device = self.k.device
        start_t = torch.tensor(starts, dtype=torch.long, device=device)
        positions = start_t[:, None] + torch.arange(num_new, device=device)  # (B, T)
        return CacheStep(
            cache=self,
            slots=tuple(slots),
            starts=tuple(starts),
            num_new=num_new,
            slot_index=torch.tensor(list(slots), dtype=torch.long, device=device),
            positions=positions,
            span=padded_span(max(starts) + num_new),
            decode=decode,
        )

    def commit(self, step: CacheStep) -> None:
        """Make the positions written by ``step`` part of their sequences."""
        if step.cache is not self:
            raise ValueError("the step belongs to another cache")
        if any(self._lengths[s] != start for s, start in zip(step.slots, step.starts, strict=True)):
            raise ValueError("a slot of the step changed between begin() and commit()")
        for slot in step.slots:
            self._lengths[slot] += step.num_new

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots or not self._in_use[slot]:
            raise ValueError(f"slot {slot} is not an allocated slot of this KV cache")


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """Zeros of which, on a CPU, only the positions ever written become resident."""
    if torch.empty(0, device=device).device.type == "cpu":
        return lazy_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)
