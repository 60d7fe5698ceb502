"""One request's state inside the engine.

Everything that belongs to a request lives here (its KV slot number, sampled tokens,
random generators, chunk cursor and vocoder caches), never on the shared models, so
requests can join and leave the batch between any two steps.
"""

from dataclasses import dataclass, field
from enum import Enum, auto

import numpy as np
import torch

from cosyserve.engine.chunking import ChunkSchedule
from cosyserve.errors import CosyserveError
from cosyserve.models.dit import Flow3Stream
from cosyserve.models.flow.stream_cache import FlowStreamCache
from cosyserve.models.hift.stream import HiFTStreamState
from cosyserve.models.hift3 import CausalHiFTStream
from cosyserve.models.sampling import LengthLimits


@dataclass(frozen=True, eq=False)
class Segment:
    """One sentence: its text ids for the LM, or speech tokens given directly (no LM)."""

    text_ids: tuple[int, ...] = ()
    speech_tokens: tuple[int, ...] | None = None


@dataclass(frozen=True, eq=False)
class GenerationSpec:
    """What the engine synthesises, already tokenised and featurised by the frontend.

    LM input per segment: ``[sos] + lm_prefix_ids + segment.text_ids + [task_id] +
    lm_prompt_speech``. Flow prompt: ``flow_prompt_tokens`` (P,) long, ``flow_prompt_mel``
    (2P, 80) float32 (P = 0 without a prompt), ``embedding`` (192,) float32.
    ``min_tokens``/``max_tokens`` force the per-segment token count (None: upstream's
    limits from the text length). ``log_id``: the id its log lines carry (the HTTP
    request id; empty: ``request_id``).
    """

    request_id: str
    segments: tuple[Segment, ...]
    embedding: torch.Tensor
    flow_prompt_tokens: torch.Tensor
    flow_prompt_mel: torch.Tensor
    lm_prefix_ids: tuple[int, ...] = ()
    lm_prompt_speech: tuple[int, ...] = ()
    seed: int = 0
    stream: bool = False
    speed: float = 1.0
    first_hop: int | None = None
    min_tokens: int | None = None
    max_tokens: int | None = None
    log_id: str = ""


class Phase(Enum):
    WAITING = auto()  # queued, no KV slot yet
    PREFILL = auto()  # feeding the current segment's LM input into the slot
    DECODE = auto()  # sampling the current segment's tokens
    VOCODE = auto()  # LM done for every segment; token2wav still has work
    FINISHED = auto()


@dataclass
class SegmentState:
    """Progress of one segment: tokens so far, chunk cursor, flow and vocoder caches.

    ``flow_cache``: the incremental flow's keys, values and convolution contexts while the
    segment streams (created by the first chunk, dropped after the last); ``flow_reserved``
    the bytes reserved for it under the engine's stream cache budget; ``flow_exact``: the
    budget had no room, so every chunk is recomputed over prompt and tokens instead.
    ``tokens``: the speech tokens for the flow; ``history``: every token the LM sampled,
    which it reads back (they differ where a long silence is cut, see :meth:`keep_token`).
    ``flow3`` and ``hift3``: a streaming CosyVoice 3 segment's flow and vocoder states
    (:mod:`cosyserve.engine.token2wav3`); ``hift`` is CosyVoice 2's vocoder state.
    """

    spec: Segment
    schedule: ChunkSchedule
    limits: LengthLimits | None
    tokens: list[int] = field(default_factory=list)
    history: list[int] = field(default_factory=list)
    silent_run: int = 0
    lm_done: bool = False
    hift: HiFTStreamState = field(default_factory=HiFTStreamState)
    flow_cache: FlowStreamCache | None = None
    flow_reserved: int = 0
    flow_exact: bool = False
    flow3: Flow3Stream | None = None
    hift3: CausalHiFTStream | None = None
    vocoded: bool = False

    def keep_token(self, token: int, silent: frozenset[int], max_silent_run: int | None) -> None:
        """Record a sampled token. Like upstream's CosyVoice 3 ``llm_job``, a run of silent
        tokens goes to the flow only up to ``max_silent_run`` long (None: no limit); the LM
        still reads every token it sampled."""
        self.history.append(token)
        self.silent_run = self.silent_run + 1 if token in silent else 0
        if max_silent_run is None or self.silent_run <= max_silent_run:
            self.tokens.append(token)


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request: audio samples (float32, 24 kHz), or the end.

    ``speech_tokens``: on a successful request's last output, every speech token it was
    synthesised from (all segments in order), for tests and usage accounting.
    """

    request_id: str
    audio: np.ndarray | None = None
    finished: bool = False
    error: CosyserveError | None = None
    first_chunk: bool = False
    speech_tokens: tuple[int, ...] | None = None


@dataclass(eq=False)
class Request:
    """A request in the engine: its spec plus all mutable progress."""

    spec: GenerationSpec
    segments: list[SegmentState]
    lm_generator: torch.Generator
    vocoder_generator: torch.Generator
    phase: Phase = Phase.WAITING
    slot: int | None = None
    lm_segment: int = 0
    vocode_segment: int = 0
    prefill_input: torch.Tensor | None = None  # (T, H) LM input embeddings being prefilled
    prefill_ids: tuple[int, ...] | None = None  # their prefix-cache key (T ids)
    prefill_pos: int = 0
    emitted_audio: bool = False

    @property
    def id(self) -> str:
        return self.spec.request_id

    @property
    def lm_state(self) -> SegmentState:
        return self.segments[self.lm_segment]

    @property
    def vocode_state(self) -> SegmentState | None:
        if self.vocode_segment >= len(self.segments):
            return None
        return self.segments[self.vocode_segment]


def generators_for(seed: int) -> tuple[torch.Generator, torch.Generator]:
    """Independent LM and vocoder generators from one seed, so neither stream's draws
    depend on how the other's work was scheduled."""
    lm_seed, vocoder_seed = np.random.SeedSequence(seed).generate_state(2, dtype=np.uint64)
    return (
        torch.Generator().manual_seed(int(lm_seed)),
        torch.Generator().manual_seed(int(vocoder_seed)),
    )
