"""The token2wav side of a step: flow (tokens -> mel) and HiFT (mel -> waveform) for a chunk."""

import numpy as np
import torch
import torch.nn.functional as F

from cosyserve.engine.config import FLOW_CACHE_MODES, FlowCacheMode
from cosyserve.engine.request import Request, SegmentState
from cosyserve.engine.stats import EngineStats
from cosyserve.models.flow.flow import Flow
from cosyserve.models.flow.prompt_cache import FlowPromptCache
from cosyserve.models.flow.stream_cache import FlowStreamCache
from cosyserve.models.hift.generator import HiFTGenerator
from cosyserve.models.hift.stream import vocode_chunk
from cosyserve.pipeline.chunking import Chunk


class Token2Wav:
    """Runs one chunk of one request through the flow and the vocoder.

    Streaming chunks follow upstream CosyVoice2Model.token2wav: intermediate chunks use
    block-causal attention with lookahead, the final chunk full attention over every token;
    the vocoder's caches live in the segment's state.

    ``flow_cache`` says how streaming chunks reach the flow (see docs/streaming-flow.md):
    ``"exact"`` recomputes prompt + all tokens for every chunk, as upstream;
    ``"cached"`` computes intermediate chunks incrementally from the segment's
    :class:`~cosyserve.models.flow.stream_cache.FlowStreamCache` (same output) and the final
    chunk as upstream; ``"incremental"`` computes the final chunk from the cache too, with
    block-causal attention: the cheapest, but its frames differ from upstream's. A stream
    whose first chunk is its last one runs as upstream in every mode. ``prompt_cache``: the
    primed voice-prompt states incremental streams start from (None: from nothing). The engine passes
    :attr:`EngineConfig.flow_cache <cosyserve.engine.config.EngineConfig>`; the default
    here is upstream's behaviour.
    """

    def __init__(
        self,
        flow: Flow,
        hift: HiFTGenerator,
        stats: EngineStats,
        flow_cache: FlowCacheMode = "exact",
        prompt_cache: FlowPromptCache | None = None,
    ) -> None:
        if flow_cache not in FLOW_CACHE_MODES:
            raise ValueError(f"flow_cache must be one of {FLOW_CACHE_MODES}, not {flow_cache!r}")
        self.flow = flow
        self.hift = hift
        self.stats = stats
        self.flow_cache = flow_cache
        self.prompt_cache = prompt_cache

    @torch.inference_mode()
    def run(self, request: Request, seg: SegmentState, chunk: Chunk) -> np.ndarray:
        """Samples (float32, mono) that ``chunk`` of ``seg`` adds to the request's audio."""
        spec = request.spec
        with self.stats.timed("flow"):
            mel = self._mel(request, seg, chunk)  # (1, 80, T)
        self.stats.flow_calls += 1
        with self.stats.timed("hift"):
            if not spec.stream:
                if spec.speed != 1.0:
                    mel = F.interpolate(mel, size=int(mel.shape[2] / spec.speed), mode="linear")
                wave, _ = self.hift.inference(mel, None, generator=request.vocoder_generator)
            else:
                wave = vocode_chunk(
                    self.hift, seg.hift, mel, finalize=chunk.finalize, generator=request.vocoder_generator
                )
        self.stats.hift_calls += 1
        audio: np.ndarray = wave[0].float().cpu().numpy()
        self.stats.audio_samples += int(audio.size)
        return audio

    def _mel(self, request: Request, seg: SegmentState, chunk: Chunk) -> torch.Tensor:
        """The mel frames of ``chunk``'s new tokens: ``(1, 80, T)`` float32."""
        spec = request.spec
        device = self.flow.speaker_proj.weight.device
        tokens = torch.tensor(seg.tokens[: chunk.token_end], dtype=torch.long, device=device)[None]
        prompt = (
            spec.flow_prompt_tokens.to(device)[None],
            spec.flow_prompt_mel.to(device)[None],
            spec.embedding.to(device)[None],
        )
        if self._incremental(seg, chunk, spec.stream):
            if seg.flow_cache is None:
                seg.flow_cache = self._new_flow_cache(request)
            mel = self.flow.stream(seg.flow_cache, tokens, *prompt, chunk.offset, chunk.finalize)
        else:
            streaming = spec.stream and not chunk.finalize
            mel = self.flow.inference(tokens, *prompt, streaming=streaming, finalize=chunk.finalize)
            mel = mel[:, :, chunk.offset * self.flow.token_mel_ratio :]
        if chunk.finalize:
            seg.flow_cache = None  # free the cached keys and values now, not with the request
        return mel

    def _new_flow_cache(self, request: Request) -> FlowStreamCache:
        """The flow cache a streamed segment of ``request`` starts from: a fork of its
        voice's primed prompt states when ``prompt_cache`` is set, else an empty one."""
        if self.prompt_cache is None:
            return self.flow.new_stream_cache()
        spec = request.spec
        return self.prompt_cache.stream_cache(spec.flow_prompt_tokens, spec.flow_prompt_mel, spec.embedding)

    def _incremental(self, seg: SegmentState, chunk: Chunk, stream: bool) -> bool:
        if not stream or self.flow_cache == "exact":
            return False
        if not chunk.finalize:
            return True
        return self.flow_cache == "incremental" and seg.flow_cache is not None
