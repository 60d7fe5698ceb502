"""The token2wav side of a step: flow (tokens -> mel) and HiFT (mel -> waveform) for a chunk."""

import numpy as np
import torch
import torch.nn.functional as F

from cosyserve.engine.request import Request, SegmentState
from cosyserve.engine.stats import EngineStats
from cosyserve.models.flow.flow import Flow
from cosyserve.models.hift.generator import HiFTGenerator
from cosyserve.models.hift.stream import vocode_chunk
from cosyserve.pipeline.chunking import Chunk


class Token2Wav:
    """Runs one chunk of one request through the flow and the vocoder.

    Streaming chunks follow upstream CosyVoice2Model.token2wav: intermediate chunks use
    block-causal attention with lookahead, the final chunk full attention over every token;
    the vocoder's caches live in the segment's state.
    """

    def __init__(self, flow: Flow, hift: HiFTGenerator, stats: EngineStats) -> None:
        self.flow = flow
        self.hift = hift
        self.stats = stats

    @torch.inference_mode()
    def run(self, request: Request, seg: SegmentState, chunk: Chunk) -> np.ndarray:
        """Samples (float32, mono) that ``chunk`` of ``seg`` adds to the request's audio."""
        spec = request.spec
        device = self.flow.speaker_proj.weight.device
        tokens = torch.tensor(seg.tokens[: chunk.token_end], dtype=torch.long, device=device)[None]
        streaming = spec.stream and not chunk.finalize
        with self.stats.timed("flow"):
            mel = self.flow.inference(
                tokens,
                spec.flow_prompt_tokens.to(device)[None],
                spec.flow_prompt_mel.to(device)[None],
                spec.embedding.to(device)[None],
                streaming=streaming,
                finalize=chunk.finalize,
            )  # (1, 80, T)
        self.stats.flow_calls += 1
        mel = mel[:, :, chunk.offset * self.flow.cfg.token_mel_ratio :]
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
