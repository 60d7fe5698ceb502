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
3 s prompt and 6 s of speech; ``cache_dtype`` float16 halves that), so they share a
budget, ``cache_budget`` bytes (:data:`DEFAULT_CACHE_BUDGET_MB` unless the engine's
``flow_stream_cache_mb`` says otherwise): a stream whose cache does not fit beside the
others' recomputes its chunks as ``"exact"`` does, with upstream's cost and memory.

``prompt_cache`` (:class:`~cosyserve.models.dit.Flow3PromptCache`): a new stream starts
from its voice's primed prompt frames, so its first chunk skips them, and reads them
shared, so its cache holds its own frames only (docs/streaming.md, "Primed voice prompts").
"""

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from cosyserve.engine.config import FLOW_CACHE_MODES, FlowCacheMode
from cosyserve.engine.stats import EngineStats
from cosyserve.engine.token2wav import ChunkWork, reserve_stream_cache, run_each, stream_tokens
from cosyserve.models.dit import Flow3, Flow3PromptCache, Flow3Stream, stream_cache_bytes
from cosyserve.models.hift3 import CausalHiFTGenerator, CausalHiFTStream

# Four 6 s streams with 3 s prompts in float32 on the released model.
DEFAULT_CACHE_BUDGET_MB = 6 * 1024


class Token2Wav3:
    """Runs the ready chunks of several requests through CosyVoice 3's flow and vocoder.

    Each chunk runs on its own (the flow takes one utterance a call); a chunk's failure is
    its own request's. A request's randomness (the vocoder's noise table) comes from its
    own generator."""

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
        return run_each(self._chunk, work)

    def _chunk(self, item: ChunkWork) -> np.ndarray:
        with self.stats.timed("flow"):
            mel = self._mel(item)
        self.stats.flow_calls += 1
        self.stats.flow_rows += 1
        with self.stats.timed("hift"):
            wave = self._wave(item, mel)
        self.stats.hift_calls += 1
        self.stats.hift_rows += 1
        audio: np.ndarray = wave[0].float().cpu().numpy()
        self.stats.audio_samples += int(audio.size)
        return audio

    # -- flow ---------------------------------------------------------------------------------

    def _mel(self, item: ChunkWork) -> Tensor:
        """The chunk's new mel frames (1, 80, T) float32."""
        spec, seg, chunk = item.request.spec, item.seg, item.chunk
        device = self.flow.speaker_proj.weight.device
        tokens = torch.tensor(seg.tokens[: chunk.token_end], dtype=torch.long, device=device)[None]
        incremental = (
            spec.stream
            and self.flow_cache != "exact"
            and (seg.flow3 is not None or (not chunk.finalize and self._reserve(item)))
        )
        if not incremental:
            streaming = spec.stream and not chunk.finalize
            mel = self.flow.inference(
                tokens,
                spec.flow_prompt_tokens.to(device)[None],
                spec.flow_prompt_mel.to(device)[None],
                spec.embedding.to(device)[None],
                streaming=streaming,
                finalize=chunk.finalize,
            )
            return mel[:, :, chunk.offset * self.flow.cfg.token_mel_ratio :]
        stream = seg.flow3
        if stream is None:
            voice = (
                spec.flow_prompt_tokens.to(device)[None],
                spec.flow_prompt_mel.to(device)[None],
                spec.embedding.to(device)[None],
            )
            frames = self._stream_frames(item)
            if self.prompt_cache is None:
                stream = Flow3Stream(self.flow, *voice, frames=frames, cache_dtype=self.cache_dtype)
            else:
                stream = self.prompt_cache.stream(*voice, frames=frames)
            seg.flow3 = stream
        done = stream.tokens.shape[1]
        if not chunk.finalize:
            split = chunk.token_end - self._lookahead
            return stream.push(tokens[:, done:split], tokens[:, split:])
        seg.flow3 = None  # the last chunk: its caches go with it
        seg.flow_reserved = 0
        if self.flow_cache == "incremental":
            return stream.push(tokens[:, done:], None)
        return stream.finish(tokens[:, done:])

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
        return stream_tokens(item) * self.flow.cfg.token_mel_ratio

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
