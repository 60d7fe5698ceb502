"""The token2wav side of a step for CosyVoice 3: the DiT flow (tokens -> mel) and the
causal vocoder (mel -> waveform), chunk by chunk.

Streaming follows upstream ``CosyVoice3Model``: intermediate chunks see chunk-causal
attention and the look-ahead tokens, the final chunk full attention over every token.
What upstream recomputes is kept instead, where that gives the same samples: the flow's
keys and values of finished attention chunks (:class:`~cosyserve.models.dit.Flow3Stream`)
and every convolution's context in the vocoder
(:class:`~cosyserve.models.hift3.CausalHiFTStream`), so a stream's later chunks cost what
its first one does. ``flow_cache`` chooses as for CosyVoice 2 (``docs/streaming.md``):
``"exact"`` recomputes prompt + tokens for every chunk, as upstream; ``"cached"`` runs
intermediate chunks incrementally and the final one as upstream (same output);
``"incremental"`` runs the final chunk incrementally too, chunk-causally (cheapest; its
last frames differ from upstream's).

The flow's stream caches are large (keys and values of 22 layers x 10 Euler steps x 2
guidance rows: 3.6 MB per mel frame in float32 on the released model, so 1.6 GB for a
3 s prompt and 6 s of speech; a ``cache_dtype`` of float16 halves that, int8 rows take
about a quarter), so they share a
budget, ``cache_budget`` bytes (:data:`DEFAULT_CACHE_BUDGET_MB` unless the engine's
``flow_stream_cache_mb`` says otherwise): a stream whose cache does not fit beside the
others' recomputes its chunks as ``"exact"`` does, with upstream's cost and memory.

``prompt_cache`` (:class:`~cosyserve.models.dit.Flow3PromptCache`): a new stream starts
from its voice's primed prompt frames, so its first chunk skips them, and reads them
shared, so its cache holds its own frames only (docs/streaming.md, "Primed voice prompts").
"""

import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from cosyserve.engine.config import FLOW_CACHE_MODES, FlowCacheMode
from cosyserve.engine.stats import EngineStats
from cosyserve.engine.token2wav import ChunkWork, reserve_stream_cache, run_each, stream_tokens
from cosyserve.models.dit import Flow3, Flow3PromptCache, Flow3Stream, push_streams, stream_cache_bytes
from cosyserve.models.hift3 import CausalHiFTGenerator, CausalHiFTStream

logger = logging.getLogger(__name__)

# Four 6 s streams with 3 s prompts in float32 on the released model.
DEFAULT_CACHE_BUDGET_MB = 6 * 1024


class Token2Wav3:
    """Runs the ready chunks of several requests through CosyVoice 3's flow and vocoder.

    Incremental chunks of streams in lockstep (equally many cached and new frames: streams
    started together) go through the DiT in one pass (:func:`~cosyserve.models.dit.push_streams`);
    every other chunk runs on its own. A failed joint pass is retried chunk by chunk, so a
    chunk's failure is its own request's. A request's randomness (the vocoder's noise
    table) comes from its own generator."""

    def __init__(
        self,
        flow: Flow3,
        hift: CausalHiFTGenerator,
        stats: EngineStats,
        flow_cache: FlowCacheMode = "exact",
        cache_budget: int = DEFAULT_CACHE_BUDGET_MB << 20,
        reserved_bytes: Callable[[], int] = lambda: 0,
        prompt_cache: Flow3PromptCache | None = None,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        """``reserved_bytes``: what the running streams' caches have reserved (the engine
        sums its segments' ``flow_reserved``); ``prompt_cache``: primed voice prompts that
        new streams start from, or None; ``cache_dtype``: what streams' keys and values
        are held in (None: the flow's dtype), as ``prompt_cache``'s."""
        if flow_cache not in FLOW_CACHE_MODES:
            raise ValueError(f"flow_cache must be one of {FLOW_CACHE_MODES}, not {flow_cache!r}")
        if cache_budget < 0:
            raise ValueError("the stream cache budget must not be negative")
        self.flow = flow
        self.hift = hift
        self.stats = stats
        self.flow_cache = flow_cache
        self.cache_budget = cache_budget
        self.reserved_bytes = reserved_bytes
        self.prompt_cache = prompt_cache
        self.cache_dtype = cache_dtype
        self._lookahead = flow.cfg.pre_lookahead_len

    @torch.inference_mode()
    def run(self, work: list[ChunkWork]) -> list[np.ndarray | Exception]:
        """Per chunk, the samples (float32, mono) it adds to its request's audio, or the
        error that failed it."""
        joint = self._joint_mels(work)
        return run_each(lambda i: self._chunk(work[i], joint.get(i)), range(len(work)))

    def _chunk(self, item: ChunkWork, mel: Tensor | None) -> np.ndarray:
        """``item``'s samples from its flow output ``mel``, computed alone when None."""
        if mel is None:
            with self.stats.timed("flow"):
                mel = self._mel(item)
            self._count_flow(1)
        with self.stats.timed("hift"):
            wave = self._wave(item, mel)
        self.stats.hift_calls += 1
        self.stats.hift_rows += 1
        audio: np.ndarray = wave[0].float().cpu().numpy()
        self.stats.audio_samples += int(audio.size)
        return audio

    def _count_flow(self, rows: int) -> None:
        self.stats.flow_calls += 1
        self.stats.flow_rows += rows

    # -- flow ---------------------------------------------------------------------------------

    def _joint_mels(self, work: list[ChunkWork]) -> dict[int, Tensor]:
        """The mels of the chunks that pushed with others in one DiT pass, by index in
        ``work``. A pass that fails leaves its chunks to run alone."""
        groups: dict[tuple[int, int], list[tuple[int, Flow3Stream, Tensor, Tensor | None]]] = {}
        for i, item in enumerate(work):
            try:
                stream = self._stream(item)
            except torch.AcceleratorError:
                raise
            except Exception:
                continue  # its own run fails it with the same error
            if stream is None or (item.chunk.finalize and self.flow_cache != "incremental"):
                continue
            new, lookahead = self._push_tokens(item, stream)
            key = (stream.cached_frames, stream.pending_frames(new))
            groups.setdefault(key, []).append((i, stream, new, lookahead))
        mels: dict[int, Tensor] = {}
        for group in groups.values():
            if len(group) < 2:
                continue
            indices, streams, news, lookaheads = zip(*group, strict=True)
            try:
                with self.stats.timed("flow"):
                    pushed = push_streams(streams, news, lookaheads)
            except torch.AcceleratorError:
                raise
            except Exception:
                logger.warning("a joint flow pass of %d streams failed; running them alone", len(group))
                continue
            self._count_flow(len(group))
            for i, mel in zip(indices, pushed, strict=True):
                self._end_stream(work[i])
                mels[i] = mel
        return mels

    def _mel(self, item: ChunkWork) -> Tensor:
        """The chunk's new mel frames (1, 80, T) float32, computed alone."""
        spec, chunk = item.request.spec, item.chunk
        stream = self._stream(item)
        if stream is None:
            device = self.flow.speaker_proj.weight.device
            mel = self.flow.inference(
                self._tokens(item),
                spec.flow_prompt_tokens.to(device)[None],
                spec.flow_prompt_mel.to(device)[None],
                spec.embedding.to(device)[None],
                streaming=spec.stream and not chunk.finalize,
                finalize=chunk.finalize,
            )
            return mel[:, :, chunk.offset * self._ratio :]
        self._end_stream(item)
        new, lookahead = self._push_tokens(item, stream)
        if chunk.finalize and self.flow_cache != "incremental":
            return stream.finish(new)
        return stream.push(new, lookahead)

    def _stream(self, item: ChunkWork) -> Flow3Stream | None:
        """``item``'s segment's incremental stream (made now for its first chunk), or None
        when the chunk is recomputed over every token."""
        spec, seg, chunk = item.request.spec, item.seg, item.chunk
        incremental = (
            spec.stream
            and self.flow_cache != "exact"
            and (seg.flow3 is not None or (not chunk.finalize and self._reserve(item)))
        )
        if not incremental:
            return None
        if seg.flow3 is None:
            device = self.flow.speaker_proj.weight.device
            voice = (
                spec.flow_prompt_tokens.to(device)[None],
                spec.flow_prompt_mel.to(device)[None],
                spec.embedding.to(device)[None],
            )
            frames = self._stream_frames(item)
            if self.prompt_cache is None:
                seg.flow3 = Flow3Stream(self.flow, *voice, frames=frames, cache_dtype=self.cache_dtype)
            else:
                seg.flow3 = self.prompt_cache.stream(*voice, frames=frames)
        return seg.flow3

    def _push_tokens(self, item: ChunkWork, stream: Flow3Stream) -> tuple[Tensor, Tensor | None]:
        """The chunk's tokens after those ``stream`` has, and their look-ahead (None for
        the last chunk)."""
        tokens = self._tokens(item)
        done = stream.tokens.shape[1]
        if item.chunk.finalize:
            return tokens[:, done:], None
        split = item.chunk.token_end - self._lookahead
        return tokens[:, done:split], tokens[:, split:]

    def _tokens(self, item: ChunkWork) -> Tensor:
        """The segment's tokens up to the chunk's end (look-ahead included), ``(1, N)``."""
        device = self.flow.speaker_proj.weight.device
        return torch.tensor(item.seg.tokens[: item.chunk.token_end], dtype=torch.long, device=device)[None]

    @staticmethod
    def _end_stream(item: ChunkWork) -> None:
        """After the last chunk, the segment's stream and its caches go."""
        if item.chunk.finalize:
            item.seg.flow3 = None
            item.seg.flow_reserved = 0

    @property
    def _ratio(self) -> int:
        return self.flow.cfg.token_mel_ratio

    def _reserve(self, item: ChunkWork) -> bool:
        """Whether ``item``'s stream gets a cache: it fits the budget beside the others'
        (then it is reserved for the longest the segment can get), or recomputes every chunk."""
        if item.seg.flow_exact:
            return False
        own = self._stream_frames(item) - self._primed_frames(item)
        need = stream_cache_bytes(self.flow, own, self.cache_dtype)
        room = self.cache_budget - self.reserved_bytes() if self.cache_budget else need
        return reserve_stream_cache(item, need, room, self.stats)

    def _stream_frames(self, item: ChunkWork) -> int:
        """The most mel frames ``item``'s stream can reach: its prompt's and its longest output's."""
        return stream_tokens(item) * self._ratio

    def _primed_frames(self, item: ChunkWork) -> int:
        """The frames ``item``'s stream reads from its voice's primed prompt."""
        if self.prompt_cache is None:
            return 0
        spec = item.request.spec
        return self.prompt_cache.primed_frames(spec.flow_prompt_tokens.numel(), spec.flow_prompt_mel.shape[0])

    # -- vocoder ------------------------------------------------------------------------------

    def _wave(self, item: ChunkWork, mel: Tensor) -> Tensor:
        """The chunk's samples (1, L), clipped as upstream's."""
        spec, seg, chunk = item.request.spec, item.seg, item.chunk
        if not spec.stream:
            if spec.speed != 1.0:
                mel = F.interpolate(mel, size=int(mel.shape[2] / spec.speed), mode="linear")
            wave, _ = self.hift.inference(mel, finalize=True, noise_seed=_noise_seed(item))
            return wave
        if seg.hift3 is None:
            seg.hift3 = CausalHiFTStream(self.hift, noise_seed=_noise_seed(item))
        wave = seg.hift3.push(mel, finalize=chunk.finalize)
        if chunk.finalize:
            seg.hift3 = None
        return wave


def _noise_seed(item: ChunkWork) -> int:
    """The vocoder noise table of ``item``'s request: drawn from its own generator, so
    that the same request seed gives the same audio."""
    return int(torch.randint(0, 2**31 - 1, (1,), generator=item.request.vocoder_generator))
