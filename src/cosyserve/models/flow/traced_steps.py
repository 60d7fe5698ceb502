"""The estimator's calls replayed from TorchScript traces (CPU).

A stream's first chunk runs 10 Euler steps of the estimator over about 10 new frames: some
8,000 small op calls each, whose Python and dispatch cost more than their arithmetic. A
trace replays the same ops without the Python between them.

A trace cannot read the per-stream caches (:class:`LayerStates`, keyed by module), so
its state passes through its inputs and outputs, in the order the layers run: each
attention layer gets its cached keys and values as two pieces each (those shared with a
voice's primed prompt and the stream's own, either possibly empty; a compact cache's own
ones recomputed before the call) and returns its new keys and values and its inputs
(which a compact cache keeps instead); each causal convolution gets its cached left context and returns its
left-padded input. The caller reads the caches before the call and writes them after it,
as the eager layers do during theirs. The estimator's packed bf16 weights are inputs too:
a trace cannot hold oneDNN's opaque tensors as constants.

The sizes of a trace's ops follow its inputs, so one trace serves every batch, chunk and
cached length; the branches its example took stay fixed, so there is one per branch:
with or without an attention bias, and, where the convolutions' weights are not packed
(float32), convolutions as matrix products or not
(:func:`~cosyserve.models.flow.blocks.runs_as_matmul`): two or four traces.

One more replays calls without cached state and without an attention bias over long
inputs: a non-streaming request's flow, alone or batched with requests of its length
(each estimator call took 0.236 against 0.265 s on the full model, 3 s of prompt and 6 s
of audio, for about 84 MiB). The streaming traces could serve those calls with nothing
cached, but then copy every layer's keys and values into the joined history they attend
to, which took most of the gain. Other calls without state (several lengths batched, a
stream recomputed whole) run eagerly.
"""

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from cosyserve.models.flow.blocks import SelfAttention, runs_as_matmul
from cosyserve.models.flow.estimator import Estimator
from cosyserve.models.flow.stream_cache import LayerStates
from cosyserve.models.packed_linear import PackedLinear
from cosyserve.models.torchscript import Trace, replay, trace_frozen
from cosyserve.models.trace_cache import TraceCache

logger = logging.getLogger(__name__)

# The examples traces are recorded on: cached positions, and new frames (a first chunk's,
# then a later chunk's, whose unpacked convolutions are not matrix products).
_EXAMPLE_CACHED = 50
_EXAMPLE_FRAMES = (10, 50)
_EXAMPLE_BATCH = 2


@dataclass(frozen=True)
class _Call:
    """One stateful layer call, in the order the estimator makes them: an attention layer,
    or a causal convolution with its left context ``width``."""

    module: nn.Module
    width: int = 0


class _StateInputs(LayerStates):
    """Inside a trace: each layer's cached state from the trace's inputs, in call order,
    and its new state collected as outputs. ``calls`` records which layer made each call."""

    def __init__(self, inputs: Iterator[Tensor]) -> None:
        super().__init__()
        self._inputs = inputs
        self.outputs: list[Tensor] = []
        self.calls: list[_Call] = []

    def attend(
        self, layer: nn.Module, k: Tensor, v: Tensor, inputs: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        if inputs is None:
            raise RuntimeError("a traced attention layer must pass its inputs (compact caches keep them)")
        k1, k2, v1, v2 = (next(self._inputs) for _ in range(4))
        self.outputs += [k, v, inputs]
        self.calls.append(_Call(layer))
        return torch.cat([k1, k2, k], dim=2), torch.cat([v1, v2, v], dim=2)

    def left_pad(self, conv: nn.Module, x: Tensor, width: int) -> Tensor:
        padded = torch.cat([next(self._inputs), x], dim=2)
        self.outputs.append(padded)
        self.calls.append(_Call(conv, width))
        return padded


class _ExampleStates(LayerStates):
    """States of ``cached`` zero positions for every layer, of ``like``'s batch and dtype:
    read by the eager call that records the calls' order before tracing, and as the
    traces' examples (:meth:`TracedSteps._cached`)."""

    def __init__(self, cached: int, like: Tensor) -> None:
        super().__init__()
        self.cached_length = cached
        self.like = like
        self.calls: list[_Call] = []

    def attend(
        self, layer: nn.Module, k: Tensor, v: Tensor, inputs: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        (past,), _ = self.cached(layer)
        self.calls.append(_Call(layer))
        return torch.cat([past, k], dim=2), torch.cat([past, v], dim=2)

    def left_pad(self, conv: nn.Module, x: Tensor, width: int) -> Tensor:
        self.calls.append(_Call(conv, width))
        return torch.cat([self.context(conv, x.shape[0], x.shape[1], width, x), x], dim=2)

    def cached(self, layer: nn.Module) -> tuple[list[Tensor], list[Tensor]]:
        assert isinstance(layer, SelfAttention)
        past = self.like.new_zeros(self.like.shape[0], layer.heads, self.cached_length, layer.head_dim)
        return [past], [past]


class _StepModule(nn.Module):
    """The estimator with its state as inputs and outputs (if ``stateful``), for tracing."""

    def __init__(self, estimator: Estimator, stateful: bool, with_bias: bool, weights: int) -> None:
        super().__init__()
        self.estimator = estimator
        self.stateful = stateful
        self.with_bias = with_bias
        self.weights = weights
        self.calls: list[_Call] = []

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        """``inputs``: the estimator's ``x, mask, mu, t, spks, cond``, its bias (if
        ``with_bias``), the packed weights (unused here: the tracer records them as
        inputs), then the layers' cached states (if ``stateful``)."""
        x, mask, mu, t, spks, cond, *rest = inputs
        bias = rest[0] if self.with_bias else None
        if not self.stateful:
            return (self.estimator(x, mask, mu, t, spks, cond, bias),)
        states = _StateInputs(iter(rest[int(self.with_bias) + self.weights :]))
        velocity = self.estimator(x, mask, mu, t, spks, cond, bias, states)
        self.calls = states.calls
        return (velocity, *states.outputs)


class TracedSteps:
    """Replays :meth:`Estimator.forward` from traces: with ``states`` (incremental
    streaming), and without them or a bias; :meth:`capture` records them. Calls where no
    trace can be made run eagerly."""

    def __init__(self, estimator: Estimator) -> None:
        self.estimator = estimator
        self._weights = tuple(m.packed for m in estimator.modules() if isinstance(m, PackedLinear))
        self._convs = [m for m in estimator.modules() if isinstance(m, nn.Conv1d)]
        # Keyed by (stateful, with_bias, each convolution's branch).
        self._traces: dict[tuple[bool, bool, tuple[bool, ...]], Trace] = {}
        self._calls: list[_Call] = []

    def capture(self, dtype: torch.dtype, cache: TraceCache | None = None) -> bool:
        """Record the traces on examples in ``dtype`` (or take them from ``cache``); False
        (and eager calls) if TorchScript cannot trace the estimator."""
        examples = {self._branches(_EXAMPLE_BATCH, frames): frames for frames in _EXAMPLE_FRAMES}
        try:
            for branches, frames in examples.items():
                for with_bias in (False, True):
                    self._traces[True, with_bias, branches] = self._trace(
                        frames, True, with_bias, dtype, cache
                    )
            long = _EXAMPLE_FRAMES[-1]
            self._traces[False, False, self._branches(_EXAMPLE_BATCH, long)] = self._trace(
                long, False, False, dtype, cache
            )
        except (RuntimeError, TypeError, AttributeError) as exc:
            reason = type(exc).__name__
            logger.warning("flow steps run eagerly: the estimator could not be traced (%s)", reason)
            self._traces.clear()
            return False
        return True

    @property
    def traces(self) -> int:
        """How many traces :meth:`capture` recorded."""
        return len(self._traces)

    def __call__(self, inputs: Sequence[Tensor], bias: Tensor | None, states: LayerStates | None) -> Tensor:
        """:meth:`Estimator.forward` of ``inputs`` (its ``x, mask, mu, t, spks, cond``),
        ``bias`` and ``states`` (None: a call without cached state): the velocity
        ``(B, 80, T)``, and the layers' new states written to ``states``."""
        x = inputs[0]
        key = (states is not None, bias is not None, self._branches(x.shape[0], x.shape[2]))
        trace = self._traces.get(key)
        if trace is None:
            velocity: Tensor = self.estimator(*inputs, bias, states)
            return velocity
        biases = [] if bias is None else [bias]
        cached = [] if states is None else self._cached(states, x)
        outputs: tuple[Tensor, ...] = replay(trace, *inputs, *biases, *self._weights, *cached)
        if states is not None:
            self._store(states, outputs[1:])
        return outputs[0]

    def _branches(self, batch: int, frames: int) -> tuple[bool, ...]:
        """Whether each convolution runs as a matrix product for an input of ``batch`` rows
        and ``frames`` frames (every estimator convolution outputs its input's frames)."""
        return tuple(runs_as_matmul(conv, batch, frames) for conv in self._convs)

    def _cached(self, states: LayerStates, x: Tensor) -> list[Tensor]:
        """The layers' cached states in call order, as the traces take them."""
        inputs: list[Tensor] = []
        batch = x.shape[0]
        for call in self._calls:
            module = call.module
            if isinstance(module, SelfAttention):
                empty = x.new_empty(batch, module.heads, 0, module.head_dim)
                keys, values = states.cached(module)
                inputs += _two(keys, empty) + _two(values, empty)
            else:
                assert isinstance(module, nn.Conv1d)
                inputs.append(states.context(module, batch, module.in_channels, call.width, x))
        return inputs

    def _store(self, states: LayerStates, outputs: Sequence[Tensor]) -> None:
        """Write the layers' new states (the traces' outputs after the velocity)."""
        position = 0
        for call in self._calls:
            if isinstance(call.module, SelfAttention):
                states.store(call.module, *outputs[position : position + 3])
                position += 3
            else:
                states.store_context(call.module, outputs[position], call.width)
                position += 1

    def _trace(
        self, frames: int, stateful: bool, with_bias: bool, dtype: torch.dtype, cache: TraceCache | None
    ) -> Trace:
        gen = torch.Generator().manual_seed(0)
        batch, mels = _EXAMPLE_BATCH, self.estimator.in_channels // 4  # its input: [x, mu, spks, cond]
        x, mu, cond = (torch.randn(batch, mels, frames, generator=gen).to(dtype) for _ in range(3))
        mask = torch.ones(batch, 1, frames, dtype=dtype)
        t = torch.full((batch,), 0.5, dtype=dtype)
        spks = torch.randn(batch, mels, generator=gen).to(dtype)
        cached = _EXAMPLE_CACHED if stateful else 0
        bias = torch.zeros(batch, 1, frames, cached + frames, dtype=dtype) if with_bias else None
        example = _ExampleStates(cached, x)
        if stateful and not self._calls:
            # The layers' order, from one eager call (each trace made checks it): the
            # traces' state inputs follow it.
            self.estimator(x, mask, mu, t, spks, cond, bias, example)
            self._calls = example.calls
        module = _StepModule(self.estimator, stateful, with_bias, len(self._weights))
        biases = [] if bias is None else [bias]
        states = self._cached(example, x) if stateful else []
        inputs = (x, mask, mu, t, spks, cond, *biases, *self._weights, *states)
        frozen = trace_frozen(module, inputs) if cache is None else cache.frozen("flow", module, inputs, {})
        # A trace from the cache ran no Python (no calls): they were checked when it was made.
        if stateful and module.calls and module.calls != self._calls:
            raise RuntimeError("the traced estimator's layers ran in another order")
        replay(frozen, *inputs)  # the execution plan, built now (see replay)
        return frozen


def _two(pieces: list[Tensor], empty: Tensor) -> list[Tensor]:
    """Cached positions as exactly two pieces, empty ones added."""
    return [*pieces, *[empty] * (2 - len(pieces))]
