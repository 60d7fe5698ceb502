"""Per-request state for incremental streaming through the flow.

Streaming attention in the flow is block-causal from position 0 and every convolution
except the encoder's look-ahead is causal, so a position whose block is complete never
changes when more tokens arrive. Incremental streaming computes only positions after
the last complete block and keeps, for those before it: the keys and values of every
attention layer and the left context of every causal convolution, separately for the
encoder and for each Euler step of the sampler (both CFG branches, as one batch). A
compact cache keeps the estimator attention layers' inputs instead of their keys and
values, a quarter of the memory, and recomputes those from them on every pass. The Euler
steps' own positions may be held in a narrower dtype than the flow computes in (float16:
half a float32 flow's memory; ``torch.int8``: :class:`~cosyserve.models.int8_rows.Int8Rows`,
about a quarter); every read converts them back.

One :class:`FlowStreamCache` belongs to one segment of one request and is dropped when
the segment ends; nothing here is stored on the shared modules.
"""

from typing import Protocol, cast, runtime_checkable

import torch
from torch import Tensor, nn

from cosyserve.models.int8_rows import Held, as_dtype, copy_head, head, held_tensors, new_held, write_held


@runtime_checkable
class KeyValueSource(Protocol):
    """An attention layer whose keys and values a compact cache recomputes from its inputs."""

    def keys_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x`` ``(B, n, C)`` -> keys and values ``(B, H, n, d)`` each."""
        ...


class LayerStates:
    """The cached states of one network pass over a stream (the encoder's token-rate
    layers, its frame-rate layers, or one Euler step of the estimator).

    ``length`` positions are final and cached. During a pass the new positions start at
    ``length``; the first ``keep`` of them are final and become cached as the layers
    see them (each layer runs once per pass). :meth:`finish` then moves ``length``.
    A pass that fails before :meth:`finish` leaves the cached positions as they were, so
    it can be run again.

    The first ``shared`` positions (a fork's, see :meth:`fork`) are read from tensors
    shared with the states it was forked from, never copied or written; the stream's own
    positions after them live in buffers of its own.

    ``capacity``: the positions (shared ones included) each own buffer is allocated for at
    once from the second pass on (see :meth:`FlowStreamCache.reserve`); beyond it, buffers
    grow x1.5. The first pass allocates only what it needs: small buffers are likelier to
    come from memory the process freed (no page faults), and the first pass is the first
    chunk, whose latency users wait for.

    ``compact``: the own positions of attention layers that pass their inputs to
    :meth:`attend` are kept as those inputs (``(B, 1, n, C)``), and their keys and values
    are recomputed from them on every pass (:meth:`KeyValueSource.keys_values`). In the
    estimator that holds 256 channels a position instead of 2 x 512, for one more GEMM
    over the history per layer and pass.

    ``dtype``: what the own positions are held in (None: as computed; ``torch.int8``: int8
    rows with their scales); reads return them in the dtype they were computed in.
    """

    def __init__(self, capacity: int = 0, compact: bool = False, dtype: torch.dtype | None = None) -> None:
        self.length = 0
        self.keep = 0
        self.capacity = capacity
        self.compact = compact
        self.dtype = dtype
        self._computed: torch.dtype | None = None  # the dtype stored states came in
        self.passes = 0
        self.shared = 0
        # Keyed by the module that owns the state, so each layer finds its own.
        self._shared_keys: dict[nn.Module, Tensor] = {}  # (B, H, shared, d)
        self._shared_values: dict[nn.Module, Tensor] = {}
        self._keys: dict[nn.Module, Held] = {}  # (B, H, own capacity, d): positions from ``shared``
        self._values: dict[nn.Module, Held] = {}
        self._own_inputs: dict[nn.Module, Held] = {}  # compact: (B, 1, own capacity, C)
        self._context: dict[nn.Module, Tensor] = {}  # (B, C, kernel - 1)
        self._next_context: dict[nn.Module, Tensor] = {}  # the context after this pass

    def begin(self, keep: int) -> None:
        if keep < 0:
            raise ValueError("keep must not be negative")
        self.keep = keep

    def finish(self) -> None:
        self.length += self.keep
        self.keep = 0
        self.passes += 1
        self._context.update(self._next_context)
        self._next_context.clear()

    def attend(
        self, layer: nn.Module, k: Tensor, v: Tensor, inputs: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Keys and values of all positions so far for ``layer``'s new ``k``, ``v``
        ``(B, H, n, d)`` (computed from its ``inputs`` ``(B, n, C)``, which a compact
        cache keeps instead): ``(B, H, length + n, d)``. Without shared positions, views of
        a buffer that grows geometrically (appending costs amortised O(n), not a copy of
        the whole history per chunk); with them, the shared and own positions joined."""
        keys, values = self.attend_parts(layer, k, v, inputs)
        return _joined(keys), _joined(values)

    def attend_parts(
        self, layer: nn.Module, k: Tensor, v: Tensor, inputs: Tensor | None = None
    ) -> tuple[list[Tensor], list[Tensor]]:
        """:meth:`attend`'s keys and values as the pieces they are held in, in position
        order (the shared positions, then the own ones), for a caller that copies them
        into a batch anyway."""
        # Compact or narrower states are not what attention reads: the cached positions
        # are recomputed or converted, the new ones used as computed.
        if (self.compact and inputs is not None) or self.dtype not in (None, k.dtype):
            keys, values = self.cached(layer)
            self.store(layer, k, v, inputs)
            return [*keys, k], [*values, v]
        self.store(layer, k, v, inputs)
        end = self.length + k.shape[2] - self.shared  # in the own buffers
        keys = [as_dtype(t, k.dtype) for t in self._pieces(self._shared_keys, self._keys, layer, end)]
        values = [as_dtype(t, v.dtype) for t in self._pieces(self._shared_values, self._values, layer, end)]
        return keys, values

    def store(self, layer: nn.Module, k: Tensor, v: Tensor, inputs: Tensor | None = None) -> None:
        """Write ``layer``'s new keys and values ``(B, H, n, d)`` after the cached positions
        (a compact cache: their ``inputs`` ``(B, n, C)``)."""
        end = self.length + k.shape[2] - self.shared  # in the own buffers
        start = self.length - self.shared
        self._computed = k.dtype
        if self.compact and inputs is not None:
            # Checked once per layer here, not on every read (:meth:`cached` runs once per
            # layer and pass: a runtime protocol check there cost a stream chunk ~1-2 ms).
            if layer not in self._own_inputs and not isinstance(layer, KeyValueSource):
                raise TypeError(f"{type(layer).__name__} cannot recompute its keys and values")
            write_held(self._grown(self._own_inputs, layer, inputs[:, None], end), start, inputs[:, None])
            return
        write_held(self._grown(self._keys, layer, k, end), start, k)
        write_held(self._grown(self._values, layer, v, end), start, v)

    def cached(self, layer: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
        """``layer``'s keys and values of the cached positions, as the pieces they are held
        in (none before the first pass); a compact cache's own ones recomputed."""
        own = self.length - self.shared
        computed = self._computed
        if computed is None:  # nothing computed, nothing cached (a fork inherits its origin's)
            return [], []
        keys = [as_dtype(t, computed) for t in self._pieces(self._shared_keys, self._keys, layer, own)]
        values = [as_dtype(t, computed) for t in self._pieces(self._shared_values, self._values, layer, own)]
        if layer in self._own_inputs and own > 0:  # compact: the own positions as inputs
            source = cast(KeyValueSource, layer)  # checked when its inputs were stored
            k, v = source.keys_values(as_dtype(head(self._own_inputs[layer], own), computed)[:, 0])
            keys.append(k)
            values.append(v)
        return keys, values

    def left_pad(self, conv: nn.Module, x: Tensor, width: int) -> Tensor:
        """``x`` ``(B, C, n)`` (the new positions) with the ``width`` cached positions
        before it prepended (zeros at the start of the stream): ``(B, C, width + n)``."""
        padded = torch.cat([self.context(conv, x.shape[0], x.shape[1], width, x), x], dim=2)
        self.store_context(conv, padded, width)
        return padded

    def context(self, conv: nn.Module, batch: int, channels: int, width: int, like: Tensor) -> Tensor:
        """The ``width`` cached input positions of ``conv`` (``(batch, channels, width)``,
        zeros in ``like``'s dtype and device at the start of the stream)."""
        context = self._context.get(conv)
        if context is None:
            if self.length:
                raise RuntimeError("a causal convolution lost its cached context")
            context = like.new_zeros(batch, channels, width)
        return context

    def store_context(self, conv: nn.Module, padded: Tensor, width: int) -> None:
        """Keep, from this pass's left-padded input ``(B, C, width + n)``, the context for
        the next pass: the ``width`` positions before the new ``length``."""
        self._next_context[conv] = padded[:, :, self.keep : self.keep + width].clone()

    def fork(self, compact: bool | None = None, dtype: torch.dtype | None = None) -> "LayerStates":
        """Independent states continuing from these, sharing their cached positions without
        a copy: the fork reads them as its ``shared`` positions and writes its own into
        buffers of its own, and :meth:`left_pad` replaces a context, never mutates it. (A
        fork of a fork joins its shared and own positions into one tensor, recomputed
        where these are compact, converted where held narrower.) ``compact``: the fork's
        own (default: as these); ``dtype``: what the fork holds its own in."""
        if self.keep:
            raise RuntimeError("cannot fork states in the middle of a pass")
        fork = LayerStates(self.capacity, self.compact if compact is None else compact, dtype)
        fork.length = fork.shared = self.length
        fork._computed = self._computed
        for layer in dict.fromkeys([*self._shared_keys, *self._keys, *self._own_inputs]):
            keys, values = self.cached(layer)
            fork._shared_keys[layer], fork._shared_values[layer] = _joined(keys), _joined(values)
        fork._context = dict(self._context)
        return fork

    def tensors(self) -> list[Tensor]:
        """Every cached tensor: the shared positions, the own key and value buffers whole
        (slack included; int8 rows' data and scales), the convolution contexts."""
        own = [*self._keys.values(), *self._values.values(), *self._own_inputs.values()]
        return [
            *self._shared_keys.values(),
            *self._shared_values.values(),
            *(t for held in own for t in held_tensors(held)),
            *self._context.values(),
        ]

    def nbytes(self) -> int:
        """Memory these states hold themselves: the shared positions are those of the states
        they were forked from, and counted there."""
        shared = {id(t) for t in (*self._shared_keys.values(), *self._shared_values.values())}
        return sum(t.numel() * t.element_size() for t in self.tensors() if id(t) not in shared)

    @staticmethod
    def _pieces(
        shared: dict[nn.Module, Tensor], own: dict[nn.Module, Held], layer: nn.Module, own_end: int
    ) -> list[Held]:
        """``layer``'s positions as pieces, as held: the shared ones, then the first
        ``own_end`` of its own buffer (left out when empty, unless it is all there is)."""
        parts: list[Held] = [shared[layer]] if layer in shared else []
        if layer in own and (own_end > 0 or not parts):
            parts.append(head(own[layer], own_end))
        return parts

    def _grown(self, buffers: dict[nn.Module, Held], layer: nn.Module, new: Tensor, end: int) -> Held:
        """``layer``'s own buffer, reallocated if it holds fewer than ``end`` positions."""
        buffer = buffers.get(layer)
        if buffer is not None and buffer.shape[2] >= end:
            return buffer
        # Beyond the reserved capacity x1.5: at most a third of the buffer is slack; each
        # position is copied about twice over the stream's life.
        reserved = self.capacity - self.shared if self.passes else 0
        capacity = max(end, reserved, 3 * (0 if buffer is None else buffer.shape[2]) // 2)
        shape = (new.shape[0], new.shape[1], capacity, new.shape[3])
        grown = new_held(shape, self.dtype or new.dtype, new.device)
        if buffer is not None:
            copy_head(grown, buffer, buffer.shape[2])
        buffers[layer] = grown
        return grown


def _joined(parts: list[Tensor]) -> Tensor:
    """Position pieces ``(B, H, n_i, d)`` as one ``(B, H, sum n_i, d)`` (no copy for one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


class FlowStreamCache:
    """Incremental-flow state of one streamed segment (see :meth:`Flow.stream`).

    ``tokens``: prompt + generated tokens whose encoder states are final and cached
    (a multiple of the block length); the mel frames before ``token_mel_ratio * tokens``
    are final in every layer of every Euler step too. ``finished``: the stream ended and
    the cache was emptied. ``compact``: the Euler steps' states are compact (see
    :class:`LayerStates`); the encoder's, a few per cent of the whole, are not.
    ``dtype``: what the Euler steps' own states are held in (None: as computed).
    """

    def __init__(self, n_steps: int, compact: bool = False, dtype: torch.dtype | None = None) -> None:
        self.tokens = 0
        self.finished = False
        self.compact = compact
        self.dtype = dtype
        self.encoder_tokens = LayerStates()
        self.encoder_frames = LayerStates()
        self.steps = [LayerStates(compact=compact, dtype=dtype) for _ in range(n_steps)]

    def reserve(self, tokens: int, ratio: int) -> None:
        """From the second pass on, hold every buffer at the size of ``tokens`` tokens
        (prompt included; ``ratio`` mel frames each), allocated once, instead of growing
        it x1.5 at a time from the first chunk's size.

        Growing copies the whole history into new memory each time, and the pages of the
        new buffer are faulted in again: about 200,000 pages in one pass of a 6 s stream
        with a 3 s prompt, at up to 40 µs a fault on a virtual machine
        (``docs/performance.md``, "Physical limits"). Reserved but unwritten positions cost
        address space, not memory: their pages are never touched."""
        self.encoder_tokens.capacity = tokens
        for states in (self.encoder_frames, *self.steps):
            states.capacity = ratio * tokens

    def begin(self, keep_tokens: int, ratio: int) -> None:
        """Start a pass whose first ``keep_tokens`` new tokens (``ratio`` frames each) are final."""
        self.encoder_tokens.begin(keep_tokens)
        for states in (self.encoder_frames, *self.steps):
            states.begin(ratio * keep_tokens)

    def finish(self, tokens: int, finalize: bool) -> None:
        """End a pass: ``tokens`` are now cached; the last pass of a stream frees everything."""
        if finalize:
            self.finished = True
            self.encoder_tokens, self.encoder_frames = LayerStates(), LayerStates()
            self.steps = [LayerStates(compact=self.compact, dtype=self.dtype) for _ in self.steps]
            return
        for states in self._passes():
            states.finish()
        self.tokens = tokens

    def fork(self, compact: bool | None = None, dtype: torch.dtype | None = None) -> "FlowStreamCache":
        """A cache for another stream that continues from this one's cached positions (a
        voice's primed prompt, see :meth:`Flow.prime_stream`): the cached tensors are
        shared, not copied, and neither cache's later passes change what the other sees
        (see :meth:`LayerStates.fork`). ``compact``: the fork's (default: as this one);
        ``dtype``: what the fork's Euler steps hold their own states in."""
        if self.finished:
            raise ValueError("cannot fork a finalized flow stream")
        compact = self.compact if compact is None else compact
        fork = FlowStreamCache(len(self.steps), compact, dtype)
        fork.tokens = self.tokens
        fork.encoder_tokens = self.encoder_tokens.fork()
        fork.encoder_frames = self.encoder_frames.fork()
        fork.steps = [states.fork(compact, dtype) for states in self.steps]
        return fork

    def tensors(self) -> list[Tensor]:
        """Every cached tensor of every pass."""
        return [t for states in self._passes() for t in states.tensors()]

    def nbytes(self) -> int:
        """Memory held by the cache, in bytes (the positions a fork shares with the cache it
        was forked from are counted there only)."""
        return sum(states.nbytes() for states in self._passes())

    def _passes(self) -> list[LayerStates]:
        return [self.encoder_tokens, self.encoder_frames, *self.steps]
