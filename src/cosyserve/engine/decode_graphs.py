"""Batched LM decode steps replayed from captured graphs: CUDA graphs on a GPU,
TorchScript traces on a CPU.

A decode step of a 0.5B model is a few hundred small kernels; launched one by one from
Python, a GPU spends most of the step waiting for the launches. A CUDA graph records
the launches of one step once and replays them with one call. On a CPU the same step
spends about a quarter of its time in Python and dispatch between its ops; a TorchScript
trace records the ops once and replays them in TorchScript's interpreter (a batch-1 int8
step of the full model, 2 cores of an AMX Xeon: 23 against 31 ms;
``EngineConfig.traced_decode`` says what it costs). Both work on static buffers:

- the host fills the buffers with the step's tokens, slots and positions, replays the
  step and reads the log-probs of the real rows;
- each row's keys are gathered from the KV cache up to the step's span, with a mask
  computed in the step from the rows' positions.

A CUDA graph fixes every shape, so its steps come in buckets: the batch is padded up to a
captured size (1, 2, 4, ... ``max_batch``), padded rows writing their keys and values into a
scratch slot of the KV cache that no request gets, and the keys are read up to a captured
span (128, 256, ... the cache's capacity) instead of the batch's longest sequence (each
row's result is the same bits either way: :mod:`cosyserve.models.span_attention`). A trace
takes its shapes from its input (:data:`Step`), so two traces serve every step: one for a
lone row (whose speech head takes another branch, ``SpeechLM.speech_log_probs``) and
one for any larger batch, each over the step's own span.

The KV cache's bookkeeping (which slot holds how many positions) stays on the host, in
:meth:`KVCache.begin` and :meth:`KVCache.commit` as for an eager step. Prefill stays
eager: its lengths vary and it runs once per request.

How a step is captured is a :class:`Capture` passed in: :class:`CudaGraphCapture` on a
GPU, :class:`TraceCapture` on a CPU; :class:`EagerCapture` replays by running the step
again, which checks the static-buffer path against the eager one.
"""

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from cosyserve.accel.quantize import Int8DynamicLinear
from cosyserve.models.kv_cache import KVCache, causal_mask
from cosyserve.models.span_attention import KEY_BLOCK, padded_span
from cosyserve.models.speech_lm import AnySpeechLM
from cosyserve.models.torchscript import Trace, replay, trace_frozen
from cosyserve.models.trace_cache import TraceCache

# A step's work for the shape of its argument: a (B, span) view whose sizes are the step's
# rows and the keys each reads (traced, they stay sizes of an input, not constants).
# Returns the (B, V) log-probs.
Step = Callable[[torch.Tensor], torch.Tensor]
Replay = Callable[[torch.Tensor], torch.Tensor]

_FIRST_SPAN = 128

logger = logging.getLogger(__name__)


class Capture(Protocol):
    """Records ``step`` at ``shape`` and returns its replay. ``shape_free``: the replay
    takes any shape (a trace); otherwise only the one it was captured at. ``buffers``: the
    tensors the step reads that the host rewrites between replays (tokens, slots,
    positions); ``state``: the other tensors outside the LM that it reads or writes in
    place (the KV cache, scratch), by name."""

    @property
    def shape_free(self) -> bool: ...

    def __call__(
        self,
        step: Step,
        shape: torch.Tensor,
        buffers: Sequence[torch.Tensor],
        state: Mapping[str, torch.Tensor],
    ) -> Replay: ...


@dataclass(frozen=True)
class EagerCapture:
    """No graph: each replay runs the step again, on the same buffers. ``shape_free``:
    replay every shape (as a trace does) or only the captured buckets' (as CUDA graphs)."""

    shape_free: bool = False

    def __call__(
        self,
        step: Step,
        shape: torch.Tensor,
        buffers: Sequence[torch.Tensor],
        state: Mapping[str, torch.Tensor],
    ) -> Replay:
        return step


class _StepModule(nn.Module):
    """``step`` as a module that holds ``lm``: tracing records calls on objects that belong
    to the traced module, and the int8 Linears' packed weights are such objects."""

    def __init__(self, lm: AnySpeechLM, step: Step) -> None:
        super().__init__()
        self.lm = lm
        self.step = step

    def forward(self, shape: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        """``inputs``: the step's buffers and oneDNN weights, unused here: the tracer records
        the tensors it is given as inputs wherever the step reads them."""
        return self.step(shape)


class TraceCapture:
    """Records steps as TorchScript traces (CPU): a replay runs the recorded ops, with the
    step's buffers and the KV cache read and written in place, as the step does. The
    shapes of a trace's ops follow its input's, so one trace replays every batch and span
    (``shape_free``) but keeps the Python branches its example took.

    A trace holds no copy of the weights, but traces and their replays keep memory that
    eager steps do not (measured in ``EngineConfig.traced_decode``). Where the LM cannot be
    traced (torch without TorchScript, say), the step runs eagerly, with one warning. With
    ``cache``, traces come from it where it has them (:mod:`cosyserve.models.trace_cache`).
    """

    shape_free = True

    def __init__(self, lm: AnySpeechLM, cache: TraceCache | None = None) -> None:
        self.lm = lm
        self.cache = cache
        self.failed = False
        self._weights = tuple(
            module.onednn.packed
            for module in lm.modules()
            if isinstance(module, Int8DynamicLinear) and module.onednn is not None
        )

    def __call__(
        self,
        step: Step,
        shape: torch.Tensor,
        buffers: Sequence[torch.Tensor],
        state: Mapping[str, torch.Tensor],
    ) -> Replay:
        if self.failed:
            return step
        # The buffers are inputs, not constants: freezing folds ops on constants and pools
        # equal ones (the tokens and the slots are all zeros when captured), and a lone
        # row's step that read its slot through a view replayed the captured token.
        inputs = (*buffers, *self._weights)
        try:
            # A lone row's branches (its speech head) are fixed by its trace: DecodeGraphs
            # traces a lone row apart.
            module, example = _StepModule(self.lm, step), (shape, *inputs)
            traced: Trace
            if self.cache is None:
                traced = trace_frozen(module, example)
            else:
                traced = self.cache.frozen("decode", module, example, state)
        except (RuntimeError, TypeError, AttributeError) as exc:
            logger.warning("decode steps run eagerly: the LM could not be traced (%s)", type(exc).__name__)
            self.failed = True
            return step

        def replayed(shape: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = replay(traced, shape, *inputs)
            return out

        replayed(shape)  # the execution plan, built now (see replay)
        return replayed


class CudaGraphCapture:
    """Records steps as CUDA graphs sharing one memory pool (a replay runs one graph at a
    time, so their temporaries may share memory)."""

    shape_free = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self._pool = torch.cuda.graph_pool_handle()

    def __call__(
        self,
        step: Step,
        shape: torch.Tensor,
        buffers: Sequence[torch.Tensor],
        state: Mapping[str, torch.Tensor],
    ) -> Replay:
        with torch.cuda.device(self.device):
            # Warm up on a side stream first, as torch's CUDA graph docs require (lazy
            # initialisation, kernel selection), so that the capture records steady work.
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves it untyped
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    step(shape)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = step(shape)

        def replay(shape: torch.Tensor) -> torch.Tensor:
            graph.replay()
            return out

        return replay


def buckets(limit: int, first: int) -> tuple[int, ...]:
    """Powers of two from ``first`` below ``limit``, then ``limit``: (1, 2, 4, 6) for 6."""
    sizes = []
    size = first
    while size < limit:
        sizes.append(size)
        size *= 2
    return (*sizes, limit)


@dataclass(frozen=True)
class StaticDecodeStep:
    """A decode step (one new position per row) on fixed buffers, for graph capture: its
    shapes depend only on (B, ``span``) and it never reads a value back to the host.

    ``k``, ``v``: the cache's (layers, slots, H_kv, capacity, D); ``slot_index``: (B,)
    long; ``positions``: (B, 1) long; ``mask``: (B, 1, 1, span) bool, key ``s`` visible to
    row ``b`` where ``s <= positions[b]``; ``keys``, ``values``: (B, H_kv, span, D) that
    every layer gathers its rows' history into (a lone row on a CPU reads its slot in
    place instead). One buffer for all layers means a replay
    allocates no history per layer: a TorchScript replay of 16 rows of 2048 positions grew
    the process by 368 MiB with a gather per layer, 31 MiB with these.
    """

    k: torch.Tensor
    v: torch.Tensor
    slot_index: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    span: int
    keys: torch.Tensor
    values: torch.Tensor
    decode: bool = True

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``, ``v``: (B, 1, H_kv, D). Returns the rows' first ``span`` keys and values
        (B, H_kv, span, D), the new ones written in."""
        cache_k, cache_v = self.k[layer], self.v[layer]  # (slots, H_kv, capacity, D)
        if self.keys.shape[0] == 1 and cache_k.device.type == "cpu":
            return self._lone_row(cache_k, k), self._lone_row(cache_v, v)
        # Indices on dims 0 and 2 address (B, H_kv, D): a row's new key for every head.
        position = self.positions[:, 0]
        cache_k[self.slot_index, :, position] = k[:, 0].to(cache_k.dtype)
        cache_v[self.slot_index, :, position] = v[:, 0].to(cache_v.dtype)
        torch.index_select(cache_k[:, :, : self.span], 0, self.slot_index, out=self.keys)
        torch.index_select(cache_v[:, :, : self.span], 0, self.slot_index, out=self.values)
        return self.keys, self.values

    def _lone_row(self, cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """A lone row's ``new`` key or value (1, 1, H_kv, D) written at its position, and its
        slot's history as a view of ``cache`` (1, H_kv, span, D), not gathered: a traced
        batch-1 step on the full int8 model over 180 cached positions took 21.9 against
        22.8 ms (48 gathers and indexed writes of 8-16 us each), the same bits. Views at
        tensor offsets read the offset on the host, which a CUDA graph cannot capture: CPU
        only."""
        row = cache.narrow(0, self.slot_index[0], 1)  # (1, H_kv, capacity, D)
        row.narrow(2, self.positions[0, 0], 1).copy_(new.transpose(1, 2))
        return row[:, :, : self.span]


class DecodeGraphs:
    """Captured decode steps of ``lm`` over ``cache``: one per (batch size, span) bucket, or
    with a shape-free capture one for a lone row and one for any larger batch
    (:meth:`for_engine` picks the buckets).

    A capture that is not shape-free pads batches with rows of a scratch slot, which it
    takes from ``cache`` for good (``pad_slot``): give the cache one slot more than the
    requests that may hold one at once. A shape-free one borrows a slot only while its
    steps are captured.
    """

    def __init__(
        self,
        lm: AnySpeechLM,
        cache: KVCache,
        capture: Capture,
        batch_sizes: Sequence[int],
        spans: Sequence[int],
    ) -> None:
        if not batch_sizes or list(batch_sizes) != sorted(set(batch_sizes)) or batch_sizes[0] < 1:
            raise ValueError(f"batch sizes must be distinct, positive and ascending, got {batch_sizes}")
        if capture.shape_free and batch_sizes[0] != 1:
            raise ValueError("a shape-free capture needs a bucket of its own for a lone row")
        if not spans or list(spans) != sorted(set(spans)) or spans[0] < 1 or spans[-1] != cache.capacity:
            raise ValueError(
                f"spans must be distinct, ascending and end at the capacity {cache.capacity}, got {spans}"
            )
        if any(padded_span(span) != span for span in spans):
            raise ValueError(f"spans must be whole key blocks of {KEY_BLOCK}, got {spans}")
        self.lm = lm
        self.cache = cache
        self.shape_free = capture.shape_free
        self.batch_sizes = tuple(batch_sizes)
        self.spans = tuple(spans)
        self._scratch = scratch = cache.allocate()
        device = cache.k.device
        most = self.batch_sizes[-1]
        # Padded rows: token 0 written at position 0 of the scratch slot, seeing only it.
        self._tokens = torch.zeros(most, dtype=torch.long, device=device)
        self._slots = torch.full((most,), scratch, dtype=torch.long, device=device)
        self._positions = torch.zeros(most, 1, dtype=torch.long, device=device)
        self._keys = torch.arange(cache.capacity, device=device)
        # A step's shape argument is a view of this; it is never read.
        self._shape = torch.empty(most, cache.capacity, dtype=torch.bool, device=device)
        # The history buffers of StaticDecodeStep, flat: each step views its first part.
        _, _, heads, capacity, head_dim = cache.k.shape
        self._history = torch.empty(2, most * heads * capacity * head_dim, dtype=cache.k.dtype, device=device)
        self.replays: dict[tuple[int, int], Replay] = {}
        # The fewest rows each batch bucket serves: 1, then one more than the bucket below.
        fewest = dict(zip(self.batch_sizes, (1, *(b + 1 for b in self.batch_sizes[:-1])), strict=True))
        with torch.inference_mode():
            # Largest first: later graphs then fit in the memory the first one pooled.
            for batch in reversed(self.batch_sizes):
                for span in reversed(self.spans):
                    # A shape-free capture replays any shape, so it is made at the smallest
                    # its bucket serves, and its run at capture touches little memory.
                    rows, keys = (fewest[batch], KEY_BLOCK) if self.shape_free else (batch, span)
                    buffers = (self._tokens, self._slots, self._positions)
                    state = {"k": cache.k, "v": cache.v, "keys": self._keys, "history": self._history}
                    self.replays[batch, span] = capture(self._step, self._shape[:rows, :keys], buffers, state)
        if self.shape_free:
            # Its replays never pad: the slot goes back as free slots are, zeroed where the
            # captures' runs wrote.
            cache.k[:, scratch, :, 0] = 0
            cache.v[:, scratch, :, 0] = 0
            cache.free(scratch)

    @property
    def pad_slot(self) -> int | None:
        """The cache slot kept for padded rows; None for shape-free replays, which keep none."""
        return None if self.shape_free else self._scratch

    @classmethod
    def for_engine(cls, lm: AnySpeechLM, cache: KVCache, capture: Capture, max_batch: int) -> "DecodeGraphs":
        """Batch sizes 1, 2, 4, ... ``max_batch`` and spans 128, 256, ... the cache's
        capacity; with a shape-free capture, batch sizes 1 and ``max_batch`` and one span."""
        if capture.shape_free:
            return cls(lm, cache, capture, sorted({1, max_batch}), (cache.capacity,))
        spans = buckets(cache.capacity, min(_FIRST_SPAN, cache.capacity))
        return cls(lm, cache, capture, buckets(max_batch, 1), spans)

    def _step(self, shape: torch.Tensor) -> torch.Tensor:
        """The captured work (:data:`Step`): (B, V) float32 log-probs of the buffers' first
        B rows, over the first ``span`` keys, for ``shape`` (B, span)."""
        batch, span = shape.shape
        positions = self._positions[:batch]
        mask = causal_mask(positions, self._keys[:span])  # (B, 1, 1, span)
        _, _, heads, _, head_dim = self.cache.k.shape
        keys, values = self._history[:, : batch * heads * span * head_dim].view(
            2, batch, heads, span, head_dim
        )
        step = StaticDecodeStep(
            self.cache.k, self.cache.v, self._slots[:batch], positions, mask, span, keys, values
        )
        hidden = self.lm.qwen(self.lm.speech_embedding(self._tokens[:batch])[:, None], step)  # (B, 1, H)
        return self.lm.speech_log_probs(hidden[:, 0])

    def decode(self, tokens: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
        """:meth:`SpeechLM.decode` by replay: feed ``tokens`` (B,) into ``slots``;
        returns (B, V) float32 log-probs. B may not exceed the largest batch size."""
        n = len(slots)
        if tokens.shape != (n,):
            raise ValueError(f"tokens {tuple(tokens.shape)} must be ({n},): one per slot")
        if self.pad_slot is not None and self.pad_slot in slots:
            raise ValueError(f"slot {self.pad_slot} is the padding rows' scratch slot")
        batch = next((b for b in self.batch_sizes if b >= n), None)
        if batch is None:
            raise ValueError(f"a decode batch of {n} exceeds the largest captured, {self.batch_sizes[-1]}")
        step = self.cache.begin(slots, 1, decode=True)  # checks the slots and lengths; (B, 1) positions
        span = next(s for s in self.spans if s >= step.span)
        rows, keys = (n, step.span) if self.shape_free else (batch, span)
        self._tokens[:n].copy_(tokens)
        self._slots[:n].copy_(step.slot_index)
        self._positions[:n].copy_(step.positions)
        if rows > n:  # padded rows, only where buckets pad (and so keep the scratch slot)
            self._tokens[n:rows].zero_()
            self._slots[n:rows].fill_(self._scratch)
            self._positions[n:rows].zero_()
        log_probs = self.replays[batch, span](self._shape[:rows, :keys])[:n].clone()
        self.cache.commit(step)
        return log_probs
