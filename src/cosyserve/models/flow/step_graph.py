"""The estimator's later Euler steps of one flow call, replayed from a CUDA graph.

On a GPU a flow call is bound by kernel launches, not arithmetic: ten Euler steps of an
estimator with 56 transformer blocks issue tens of thousands of small kernels, so a call
costs about the same whatever its width (``docs/performance.md``, "NVIDIA H100"). Within
one call every step has the same shapes and reads the same inputs but ``x`` and ``t``;
so the first step runs eagerly, a step is then recorded on static copies of ``x`` and ``t``
(recording runs nothing), and steps 2-10 replay it, each replay one launch.

Only calls without cached state are captured (non-streaming requests and ``exact``
streaming chunks): an incremental stream's steps each read their own caches. A graph
lives for one call, so nothing is kept between calls and no shape needs buckets.

How a step is captured is a :data:`StepCapture`: :class:`CudaStepCapture` on a GPU;
:func:`eager_capture` replays by running the step again on the static buffers, which
checks the buffer handling on a CPU.
"""

from collections.abc import Callable

import torch
from torch import Tensor

# The step on its static buffers, and a replay of it; both return the (2B, 80, T) velocity.
Step = Callable[[], Tensor]
StepCapture = Callable[[Step], Step]


def eager_capture(step: Step) -> Step:
    """No graph: a replay runs ``step`` again."""
    return step


class CudaStepCapture:
    """Records a step as a CUDA graph on ``device``, in a memory pool of its own that
    torch's allocator frees after the graph (one shared pool is refused: torch asserts
    when a pool whose graphs were all freed is captured into again).

    The capture is begun and ended directly rather than through ``torch.cuda.graph``,
    whose entry synchronises the device and empties torch's allocator cache on every
    call. Capture errors are thread-local: work that other threads launch meanwhile does
    not break the capture."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves it untyped

    def __call__(self, step: Step) -> Step:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream()
            self._stream.wait_stream(current)  # the step's inputs are written on `current`
            with torch.cuda.stream(self._stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    out = step()
                finally:
                    graph.capture_end()
            current.wait_stream(self._stream)

        def replay() -> Tensor:
            graph.replay()
            return out

        return replay


class StepGraph:
    """One call's estimator step over fixed inputs, replayed for new ``x`` and ``t``.

    ``run(x, t)``: the estimator with the call's other inputs bound; ``x``: ``(2B, 80, T)``
    and ``t``: ``(2B,)``, the step just run eagerly (their shapes are every step's). The
    returned velocity is the graph's output buffer, overwritten by the next replay."""

    def __init__(self, run: Callable[[Tensor, Tensor], Tensor], x: Tensor, t: Tensor, capture: StepCapture):
        self._x = x.clone()
        self._t = t.clone()
        self._replay = capture(lambda: run(self._x, self._t))

    def __call__(self, x: Tensor, t: Tensor) -> Tensor:
        self._x.copy_(x)
        self._t.copy_(t)
        return self._replay()
