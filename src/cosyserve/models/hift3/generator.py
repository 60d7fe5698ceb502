"""The CosyVoice 3 vocoder: 80-bin log-mel at 50 Hz -> 24 kHz waveform (upstream's
CausalHiFTGenerator with CausalConvRNNF0Predictor).

CosyVoice 2's HiFT (:mod:`cosyserve.models.hift`) made causal: every convolution reads the
past only, except the f0 predictor's first (3 frames of look-ahead) and ``conv_pre``
(``conv_pre_look_right`` frames); the upsampling convolutions repeat each frame (nearest)
and then convolve causally; the source's phase is held per frame and its noise comes from a
fixed table. Everything here runs step by step (:meth:`CausalHiFTGenerator.excite_step`,
:meth:`CausalHiFTGenerator.decode_step`) with per-stream state, so that a stream costs the
same per chunk however long it is (:class:`~cosyserve.models.hift3.stream.CausalHiFTStream`);
:meth:`CausalHiFTGenerator.inference` is one step over a whole input, with upstream's
signature and output lengths.
"""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.modeldir.hparams3 import HiFT3Config
from cosyserve.models.hift.f0 import NUM_CONV_LAYERS
from cosyserve.models.hift.generator import check_hift_config, hift_checkpoint_table
from cosyserve.models.hift.source import SourceOptions
from cosyserve.models.hift3.causal import CausalResBlock, Context, causal_context, conv_step
from cosyserve.models.hift3.f0 import LOOK_AHEAD, CausalF0Predictor, F0State
from cosyserve.models.hift3.source import CausalSineSource, SourceState
from cosyserve.models.hift3.spectral import (
    AnalysisState,
    Frames,
    SynthesisState,
    istft_step,
    new_synthesis_state,
    stft_step,
)
from cosyserve.weights.checkpoint import CheckpointTable

# Upstream's fixed kernel of conv_post, and its magnitude ceiling before the iSTFT.
_POST_KERNEL = 7
_MAX_MAGNITUDE = 1e2
# A non-final call of upstream's decode drops one more mel frame of samples at its end
# than its look-ahead needs (those samples are final already; upstream emits them later).
HELD_FRAMES = 1


@dataclass
class _StageState:
    up: Context
    down: Context
    source_block: list[tuple[Context, Context]]
    blocks: list[list[tuple[Context, Context]]]
    # Frames of the two branches made but not yet added (the source branch runs ahead).
    x_pending: Tensor
    s_pending: Tensor
    reflected: bool


class _CausalStage(nn.Module):
    """leaky ReLU -> nearest upsampling (x ``rate``) -> causal conv, plus the source
    spectrogram brought to the same rate and refined by a ResBlock, then the mean of the
    stage's ResBlocks."""

    def __init__(self, cfg: HiFT3Config, index: int) -> None:
        super().__init__()
        in_ch = cfg.base_channels // 2**index
        out_ch = cfg.base_channels // 2 ** (index + 1)
        self.rate, self.slope = cfg.upsample_rates[index], cfg.lrelu_slope
        # The iSTFT of n samples needs n / hop + 1 frames, one more than the upsampled
        # length; the last stage reflects one frame at the start to supply it.
        self.reflect_start = index == len(cfg.upsample_rates) - 1
        self.up = nn.Conv1d(in_ch, out_ch, cfg.upsample_kernel_sizes[index])
        # Spectrogram frames per frame of this stage's output.
        self.stride = math.prod(cfg.upsample_rates[index + 1 :])
        spec_ch = cfg.istft_n_fft + 2
        self.source_down = (
            nn.Conv1d(spec_ch, out_ch, 1)
            if self.stride == 1
            else nn.Conv1d(spec_ch, out_ch, 2 * self.stride, self.stride)
        )
        self.source_block = CausalResBlock(
            out_ch, cfg.source_resblock_kernel_sizes[index], cfg.source_resblock_dilation_sizes[index]
        )
        kernels_dilations = zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
        self.blocks = nn.ModuleList(CausalResBlock(out_ch, k, d) for k, d in kernels_dilations)

    def new_state(self, batch: int, like: Tensor) -> _StageState:
        empty = like.new_zeros(batch, self.up.out_channels, 0)
        return _StageState(
            up=causal_context(self.up, batch, like),
            # Upstream pads the strided convolution by stride - 1 zeros (not kernel - 1).
            down=Context.zeros(batch, self.source_down.in_channels, self.stride - 1, like),
            source_block=self.source_block.new_state(batch, like),
            blocks=[block.new_state(batch, like) for block in self._blocks()],
            x_pending=empty,
            s_pending=empty,
            reflected=not self.reflect_start,
        )

    def step(self, x: Tensor, spec: Tensor, state: _StageState) -> Tensor:
        """``x``: (B, C_in, n) new frames; ``spec``: (B, n_fft + 2, s) new source spectrogram
        frames -> (B, C_out, m), the new frames both branches have reached."""
        x = F.leaky_relu(x, self.slope).repeat_interleave(self.rate, dim=2)
        state.x_pending = torch.cat([state.x_pending, conv_step(self.up, x, state.up)], dim=2)
        if not state.reflected and state.x_pending.shape[2] >= 2:
            state.x_pending = torch.cat([state.x_pending[:, :, 1:2], state.x_pending], dim=2)
            state.reflected = True
        source = self.source_block.step(conv_step(self.source_down, spec, state.down), state.source_block)
        state.s_pending = torch.cat([state.s_pending, source], dim=2)
        ready = min(state.x_pending.shape[2] if state.reflected else 0, state.s_pending.shape[2])
        fused = state.x_pending[:, :, :ready] + state.s_pending[:, :, :ready]
        state.x_pending = state.x_pending[:, :, ready:].clone()
        state.s_pending = state.s_pending[:, :, ready:].clone()
        blocks = self._blocks()
        total = blocks[0].step(fused, state.blocks[0])
        for block, block_state in zip(blocks[1:], state.blocks[1:], strict=True):
            total = total + block.step(fused, block_state)
        return total / len(blocks)

    def _blocks(self) -> list[CausalResBlock]:
        return [b for b in self.blocks if isinstance(b, CausalResBlock)]


@dataclass
class ExciteState:
    """One stream's mel -> source state."""

    f0: F0State
    source: SourceState


@dataclass
class DecodeState:
    """One stream's (mel, source) -> waveform state."""

    pre: Context
    spectrum: AnalysisState
    stages: list[_StageState]
    post: Context
    synthesis: SynthesisState


class CausalHiFTGenerator(nn.Module):
    """mel -> waveform. fp32 (the f0 predictor computes in float64); batch B >= 1 with equal
    lengths, all rows reading the same noise table (as upstream's, shaped (1, L, H))."""

    window: Tensor

    def __init__(self, cfg: HiFT3Config) -> None:
        super().__init__()
        _check_config(cfg)
        self.cfg = cfg
        self.frames = Frames(cfg.istft_n_fft, cfg.istft_hop_len)
        self.f0_predictor = CausalF0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels)
        self.source = CausalSineSource(SourceOptions.of(cfg))
        self.conv_pre = nn.Conv1d(cfg.in_channels, cfg.base_channels, cfg.conv_pre_look_right + 1)
        self.stages = nn.ModuleList(_CausalStage(cfg, i) for i in range(len(cfg.upsample_rates)))
        last_ch = cfg.base_channels // 2 ** len(cfg.upsample_rates)
        self.conv_post = nn.Conv1d(last_ch, cfg.istft_n_fft + 2, _POST_KERNEL)
        # Computed, not stored: hift.pt has no window. float64 then rounded gives scipy's
        # periodic Hann bit for bit (torch's float32 window differs in the last bit).
        window = torch.hann_window(cfg.istft_n_fft, periodic=True, dtype=torch.float64)
        self.register_buffer("window", window.to(torch.float32), persistent=False)

    # -- step by step -------------------------------------------------------------------

    def new_excite_state(self, batch: int, like: Tensor, noise_seed: int) -> ExciteState:
        return ExciteState(
            f0=self.f0_predictor.new_state(batch, like.to(torch.float64)),
            source=self.source.new_state(batch, like, noise_seed),
        )

    def new_decode_state(self, batch: int, like: Tensor) -> DecodeState:
        return DecodeState(
            pre=Context.zeros(batch, self.cfg.in_channels, 0, like),  # waits for its future
            spectrum=AnalysisState(pending=like.new_zeros(batch, 0)),
            stages=[stage.new_state(batch, like) for stage in self._stages()],
            post=causal_context(self.conv_post, batch, like),
            synthesis=new_synthesis_state(batch, like, self.frames),
        )

    def excite_step(self, mel: Tensor, state: ExciteState, *, final: bool) -> Tensor:
        """New mel frames (B, n_mels, n) -> the new source samples (B, 1, m * 480): one frame
        for every mel frame whose f0 look-ahead has arrived (all of them when ``final``)."""
        f0 = self.f0_predictor.step(mel.to(torch.float64), state.f0, final=final).to(mel.dtype)
        return self.source.step(f0, state.source)

    def decode_step(self, mel: Tensor, source: Tensor, state: DecodeState, *, final: bool) -> Tensor:
        """New mel frames (B, n_mels, n) and new source samples (B, 1, L) -> the new output
        samples (B, k) that no later input can change (all the rest when ``final``).
        Unclipped (see :meth:`clip`)."""
        if final:
            mel = F.pad(mel, (0, self.cfg.conv_pre_look_right))
        x = conv_step(self.conv_pre, mel, state.pre)
        spec = stft_step(source[:, 0], state.spectrum, self.window, self.frames, final=final)
        for stage, stage_state in zip(self._stages(), state.stages, strict=True):
            x = stage.step(x, spec, stage_state)
        # Default slope (0.01) here, not lrelu_slope: upstream's final activation.
        x = conv_step(self.conv_post, F.leaky_relu(x), state.post)
        bins = self.cfg.istft_n_fft // 2 + 1
        magnitude = torch.clamp(torch.exp(x[:, :bins]), max=_MAX_MAGNITUDE)
        phase = torch.sin(x[:, bins:])
        spectrum = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return istft_step(spectrum, state.synthesis, self.window, self.frames, final=final)

    def clip(self, wave: Tensor) -> Tensor:
        return torch.clamp(wave, -self.cfg.audio_limit, self.cfg.audio_limit)

    # -- whole inputs, upstream's calls -----------------------------------------------------

    @torch.inference_mode()
    def inference(self, mel: Tensor, finalize: bool = True, *, noise_seed: int = 0) -> tuple[Tensor, Tensor]:
        """Vocode ``mel`` (B, n_mels, T) as upstream's ``inference(speech_feat, finalize)``:
        -> (wave (B, T * 480), source (B, 1, T * 480)) when ``finalize``; otherwise the
        frames without their full look-ahead are left out: (wave (B, (T - 8) * 480),
        source (B, 1, (T - 3) * 480)). ``noise_seed`` picks the noise table."""
        batch = mel.shape[0]
        source = self.excite_step(mel, self.new_excite_state(batch, mel, noise_seed), final=finalize)
        decoder_mel = mel if finalize else mel[:, :, : mel.shape[2] - LOOK_AHEAD]
        return self.decode(decoder_mel, source, finalize), source

    @torch.inference_mode()
    def decode(self, mel: Tensor, source: Tensor, finalize: bool = True) -> Tensor:
        """Upstream's ``decode(x, s, finalize)``: mel (B, n_mels, T) and source (B, 1, T * 480)
        -> wave (B, T * 480), or (B, (T - conv_pre_look_right - 1) * 480) when not
        ``finalize`` (the last frames lack look-ahead and one more is held back)."""
        wave = self.decode_step(mel, source, self.new_decode_state(mel.shape[0], mel), final=finalize)
        frames = mel.shape[2] if finalize else mel.shape[2] - self.cfg.conv_pre_look_right - HELD_FRAMES
        return self.clip(wave[:, : max(0, frames) * self.cfg.upsample_factor])

    def _stages(self) -> list[_CausalStage]:
        return [s for s in self.stages if isinstance(s, _CausalStage)]


def _check_config(cfg: HiFT3Config) -> None:
    check_hift_config(cfg)
    if cfg.istft_n_fft % cfg.istft_hop_len or cfg.istft_n_fft % 2:
        raise ValueError("hift: istft n_fft must be even and a multiple of the hop")
    if cfg.conv_pre_look_right < 0:
        raise ValueError("hift: conv_pre_look_right must be >= 0")


def causal_hift_checkpoint_table(cfg: HiFT3Config) -> CheckpointTable:
    """The table between the official CosyVoice 3 ``hift.pt`` (upstream
    ``CausalHiFTGenerator`` keys, optionally under ``generator.``) and
    :class:`CausalHiFTGenerator`: CosyVoice 2's, key for key (the causal convolutions keep
    the names and weight norm; some shapes differ, checked against the module), except that
    the f0 predictor's convolutions stay (g, v) pairs (see :mod:`~cosyserve.models.hift3.f0`)."""
    base = hift_checkpoint_table(cfg)
    f0_stems = [f"f0_predictor.condnet.{2 * k}" for k in range(NUM_CONV_LAYERS)]
    ours = [f"f0_predictor.convs.{k}" for k in range(NUM_CONV_LAYERS)]
    folded = {f"{stem}.weight" for stem in f0_stems}
    entries = [(c, m) for c, m in base.entries if c not in folded]
    for stem, own in zip(f0_stems, ours, strict=True):
        for part in ("original0", "original1"):
            entries.append(
                (f"{stem}.parametrizations.weight.{part}", f"{own}.parametrizations.weight.{part}")
            )
    return replace(
        base, entries=tuple(entries), weight_norm=base.weight_norm - folded, unfolded=frozenset(f0_stems)
    )
