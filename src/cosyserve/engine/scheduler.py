"""Decides what each engine step does: who gets a KV slot, who prefills, who decodes,
which token2wav chunks run."""

from collections import deque

from cosyserve.engine.chunking import Chunk
from cosyserve.engine.config import EngineConfig
from cosyserve.engine.request import Phase, Request, SegmentState

_NEEDS_SLOT = frozenset({Phase.WAITING, Phase.PREFILL, Phase.DECODE})


class Scheduler:
    """Holds waiting and running requests in arrival order."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        """Queue ``request``. How many may be held is decided before, at admission
        (:mod:`cosyserve.engine.admission`)."""
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)

    def slots_in_use(self) -> int:
        """Running requests that hold a KV slot or are about to take one (admitted this step)."""
        return sum(1 for r in self.running if r.phase in _NEEDS_SLOT)

    def admit(self) -> list[Request]:
        """Move waiting requests into running while KV slots are free (FIFO)."""
        admitted = []
        while self.waiting and self.slots_in_use() < self.config.max_active:
            request = self.waiting.popleft()
            self.running.append(request)
            admitted.append(request)
        return admitted

    def prefill_work(self) -> list[tuple[Request, int]]:
        """(request, positions) to prefill this step, oldest first, within the step budget.

        The budget keeps a long prompt from stalling running decodes; while nothing
        decodes, every pending prompt goes in whole, so that requests arriving together
        start decoding in the same step (their streams' chunks then fall due together and
        can share flow passes)."""
        budget: int | None = self.config.prefill_chunk if self.decode_batch() else None
        work = []
        for request in self.running:
            if budget == 0:
                break
            if request.phase is Phase.PREFILL and request.prefill_input is not None:
                n = request.prefill_input.shape[0] - request.prefill_pos
                if budget is not None:
                    n = min(budget, n)
                    budget -= n
                work.append((request, n))
        return work

    def decode_batch(self) -> list[Request]:
        return [r for r in self.running if r.phase is Phase.DECODE and not r.lm_state.lm_done]

    def vocode_work(self) -> list[tuple[Request, SegmentState, Chunk]]:
        """Ready token2wav chunks, requests without audio yet first (first-packet latency),
        then arrival order; at most ``token2wav_batch`` (one per request)."""
        ready = []
        for request in self.running:
            seg = request.vocode_state
            if seg is None:
                continue
            chunk = ready_chunk(request, seg)
            if chunk is not None:
                ready.append((request, seg, chunk))
        ready.sort(key=lambda item: item[0].emitted_audio)  # stable: arrival order within groups
        return ready[: self.config.token2wav_batch]


def ready_chunk(request: Request, seg: SegmentState) -> Chunk | None:
    """The segment's next chunk if its tokens are there (non-streaming: all tokens, once)."""
    if seg.vocoded:
        return None
    if request.spec.stream:
        return seg.schedule.peek(len(seg.tokens), seg.lm_done)
    if seg.lm_done:
        return Chunk(token_end=len(seg.tokens), offset=0, finalize=True)
    return None
