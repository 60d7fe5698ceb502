"""The HiFT vocoder: 80-bin log-mel at 50 Hz -> 24 kHz waveform (upstream's HiFTGenerator;
HiFTNet = neural source filter + iSTFTNet, arXiv:2309.09493).

A predicted f0 drives a harmonic source signal; its STFT is injected at every upsampling
stage of a HiFi-GAN-style network whose output is a magnitude/phase spectrogram, turned into
samples by an inverse STFT. Our module holds plain (weight-norm folded) weights;
:func:`hift_checkpoint_table` maps the official ``hift.pt`` onto it.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.modeldir.hparams import HiFTConfig
from cosyserve.models.hift.f0 import NUM_CONV_LAYERS, F0Predictor
from cosyserve.models.hift.resblock import ResBlock
from cosyserve.models.hift.source import Excitation, HarmonicSource, SourceOptions
from cosyserve.weights.checkpoint import CheckpointTable

# Upstream's fixed kernel of conv_pre and conv_post, and its magnitude ceiling before the iSTFT.
_CONV_KERNEL = 7
_MAX_MAGNITUDE = 1e2
# CosyVoice 1 (22.05 kHz) selects a different source module upstream; only SineGen2 exists here.
_COSYVOICE1_RATE = 22050


class _UpsampleStage(nn.Module):
    """leaky ReLU -> ConvTranspose1d (x ``rate``), plus the source spectrogram brought to the
    same rate and refined by a ResBlock, then the mean of the stage's ResBlocks."""

    def __init__(self, cfg: HiFTConfig, index: int) -> None:
        super().__init__()
        in_ch = cfg.base_channels // 2**index
        out_ch = cfg.base_channels // 2 ** (index + 1)
        rate, kernel = cfg.upsample_rates[index], cfg.upsample_kernel_sizes[index]
        self.slope = cfg.lrelu_slope
        # The iSTFT of n samples needs n / hop + 1 frames, one more than the upsampled
        # length; the last stage reflects one frame at the start to supply it.
        self.pad_left = index == len(cfg.upsample_rates) - 1
        self.up = nn.ConvTranspose1d(in_ch, out_ch, kernel, rate, padding=(kernel - rate) // 2)
        # Spectrogram frames per frame of this stage's output.
        stride = 1
        for later in cfg.upsample_rates[index + 1 :]:
            stride *= later
        spec_ch = cfg.istft_n_fft + 2
        self.source_down = (
            nn.Conv1d(spec_ch, out_ch, 1)
            if stride == 1
            else nn.Conv1d(spec_ch, out_ch, 2 * stride, stride, padding=stride // 2)
        )
        self.source_block = ResBlock(
            out_ch, cfg.source_resblock_kernel_sizes[index], cfg.source_resblock_dilation_sizes[index]
        )
        kernels_dilations = zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes, strict=True)
        self.blocks = nn.ModuleList(ResBlock(out_ch, k, d) for k, d in kernels_dilations)

    def forward(self, x: Tensor, spec: Tensor) -> Tensor:
        """``x``: (B, C_in, N) -> (B, C_out, N * rate [+ 1 at the last stage]);
        ``spec``: (B, n_fft + 2, F) source spectrogram, F = the final frame count."""
        x = self.up(F.leaky_relu(x, self.slope))
        if self.pad_left:
            x = F.pad(x, (1, 0), mode="reflect")
        x = x + self.source_block(self.source_down(spec))
        total: Tensor = self.blocks[0](x)
        for block in self.blocks[1:]:
            total = total + block(x)
        return total / len(self.blocks)


class HiFTGenerator(nn.Module):
    """mel -> waveform. fp32; batch B >= 1 with equal lengths (padding is the caller's)."""

    window: Tensor

    def __init__(self, cfg: HiFTConfig) -> None:
        super().__init__()
        check_hift_config(cfg)
        self.cfg = cfg
        self.f0_predictor = F0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels)
        self.source = HarmonicSource(SourceOptions.of(cfg))
        pad = _CONV_KERNEL // 2
        self.conv_pre = nn.Conv1d(cfg.in_channels, cfg.base_channels, _CONV_KERNEL, padding=pad)
        self.stages = nn.ModuleList(_UpsampleStage(cfg, i) for i in range(len(cfg.upsample_rates)))
        last_ch = cfg.base_channels // 2 ** len(cfg.upsample_rates)
        self.conv_post = nn.Conv1d(last_ch, cfg.istft_n_fft + 2, _CONV_KERNEL, padding=pad)
        # Computed, not stored: hift.pt has no window. float64 then rounded gives scipy's
        # periodic Hann bit for bit (torch's float32 window differs in the last bit).
        window = torch.hann_window(cfg.istft_n_fft, periodic=True, dtype=torch.float64)
        self.register_buffer("window", window.to(torch.float32), persistent=False)

    @torch.inference_mode()
    def inference(
        self,
        mel: Tensor,
        cache_source: Tensor | None = None,
        *,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        excitation: Excitation | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Vocode ``mel`` (B, n_mels, T) -> (wave (B, T * 480), source (B, 1, T * 480)).

        ``cache_source`` (B or 1, 1, S), S <= T * 480: replaces the first S source samples,
        so that a streaming chunk whose mel starts with the previous chunk's last frames
        continues that chunk's excitation (upstream's ``cache_source``). The returned
        source includes the replacement; its tail is the next chunk's cache.
        Randomness comes from ``generator`` (one, or one per batch row) or is given as
        ``excitation``: exactly one of the two.
        """
        samples = mel.shape[2] * self.cfg.upsample_factor
        if excitation is None:
            if generator is None:
                raise ValueError("pass a generator or an excitation")
            excitation = Excitation.draw(mel.shape[0], self.cfg.nb_harmonics + 1, samples, generator)
        elif generator is not None:
            raise ValueError("pass a generator or an excitation, not both")
        f0 = self.f0_predictor(mel)  # (B, T)
        source: Tensor = self.source(f0, Excitation(noise=excitation.noise.to(mel.device)))
        if cache_source is not None and cache_source.shape[2] > 0:
            if cache_source.shape[2] > samples or cache_source.shape[1] != 1:
                raise ValueError(
                    f"cache_source of shape {tuple(cache_source.shape)} does not fit a source "
                    f"of shape {tuple(source.shape)}"
                )
            source[:, :, : cache_source.shape[2]] = cache_source
        return self.decode(mel, source), source

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """``mel``: (B, n_mels, T), ``source``: (B, 1, T * 480) -> wave: (B, T * 480)."""
        spec = self._stft(source[:, 0])  # (B, n_fft + 2, T * 120 + 1)
        x = self.conv_pre(mel)
        for stage in self.stages:
            x = stage(x, spec)
        # Default slope (0.01) here, not lrelu_slope: upstream's final activation.
        x = self.conv_post(F.leaky_relu(x))  # (B, n_fft + 2, T * 120 + 1)
        bins = self.cfg.istft_n_fft // 2 + 1
        wave = self._istft(torch.exp(x[:, :bins]), torch.sin(x[:, bins:]))
        return torch.clamp(wave, -self.cfg.audio_limit, self.cfg.audio_limit)

    def _stft(self, samples: Tensor) -> Tensor:
        """(B, L) -> real and imaginary parts stacked on channels: (B, n_fft + 2, L / hop + 1)."""
        n_fft = self.cfg.istft_n_fft
        spec = torch.stft(
            samples,
            n_fft,
            self.cfg.istft_hop_len,
            n_fft,
            window=self.window,
            center=True,
            pad_mode="reflect",
            return_complex=True,
        )
        return torch.cat([spec.real, spec.imag], dim=1)

    def _istft(self, magnitude: Tensor, phase: Tensor) -> Tensor:
        """magnitude, phase: (B, n_fft / 2 + 1, F) -> (B, (F - 1) * hop)."""
        magnitude = torch.clamp(magnitude, max=_MAX_MAGNITUDE)
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        n_fft = self.cfg.istft_n_fft
        return torch.istft(spec, n_fft, self.cfg.istft_hop_len, n_fft, window=self.window, center=True)


def check_hift_config(cfg: HiFTConfig) -> None:
    """Refuse a geometry the generators cannot build (both families' vocoders share it)."""
    stages = len(cfg.upsample_rates)
    per_stage = (
        cfg.upsample_kernel_sizes,
        cfg.source_resblock_kernel_sizes,
        cfg.source_resblock_dilation_sizes,
    )
    if any(len(values) != stages for values in per_stage):
        raise ValueError("hift: upsample and source-resblock settings must list one entry per stage")
    if len(cfg.resblock_kernel_sizes) != len(cfg.resblock_dilation_sizes) or not cfg.resblock_kernel_sizes:
        raise ValueError("hift: resblock kernel and dilation lists must be non-empty and of equal length")
    if cfg.base_channels % 2**stages:
        raise ValueError(f"hift: base_channels must be divisible by {2**stages}")
    if cfg.f0_in_channels != cfg.in_channels or cfg.f0_num_class != 1:
        raise ValueError("hift: the f0 predictor must read the mel and predict one value per frame")
    if cfg.sampling_rate == _COSYVOICE1_RATE:
        raise ValueError("hift: the 22.05 kHz (CosyVoice 1) source module is not supported")


def hift_checkpoint_table(cfg: HiFTConfig) -> CheckpointTable:
    """The table between the official ``hift.pt`` (upstream ``HiFTGenerator`` keys, optionally
    under ``generator.``) and :class:`HiFTGenerator`."""
    entries: list[tuple[str, str]] = []
    weight_norm: set[str] = set()

    def layer(ckpt: str, ours: str, *, normed: bool) -> None:
        entries.extend(((f"{ckpt}.weight", f"{ours}.weight"), (f"{ckpt}.bias", f"{ours}.bias")))
        if normed:
            weight_norm.add(f"{ckpt}.weight")

    def resblock(ckpt: str, ours: str, units: int) -> None:
        for j in range(units):
            entries.append((f"{ckpt}.activations1.{j}.alpha", f"{ours}.units.{j}.snake1.alpha"))
            layer(f"{ckpt}.convs1.{j}", f"{ours}.units.{j}.conv1", normed=True)
            entries.append((f"{ckpt}.activations2.{j}.alpha", f"{ours}.units.{j}.snake2.alpha"))
            layer(f"{ckpt}.convs2.{j}", f"{ours}.units.{j}.conv2", normed=True)

    for k in range(NUM_CONV_LAYERS):
        # Upstream's Sequential interleaves ELUs, so its convs sit at even indices.
        layer(f"f0_predictor.condnet.{2 * k}", f"f0_predictor.convs.{k}", normed=True)
    layer("f0_predictor.classifier", "f0_predictor.classifier", normed=False)
    layer("m_source.l_linear", "source.merge", normed=False)
    layer("conv_pre", "conv_pre", normed=True)
    kernels = len(cfg.resblock_kernel_sizes)
    for i in range(len(cfg.upsample_rates)):
        layer(f"ups.{i}", f"stages.{i}.up", normed=True)
        layer(f"source_downs.{i}", f"stages.{i}.source_down", normed=False)
        source_units = len(cfg.source_resblock_dilation_sizes[i])
        resblock(f"source_resblocks.{i}", f"stages.{i}.source_block", source_units)
        for k, dilations in enumerate(cfg.resblock_dilation_sizes):
            resblock(f"resblocks.{i * kernels + k}", f"stages.{i}.blocks.{k}", len(dilations))
    layer("conv_post", "conv_post", normed=True)
    return CheckpointTable(
        file="hift.pt", entries=tuple(entries), weight_norm=frozenset(weight_norm), strip_prefix="generator."
    )
