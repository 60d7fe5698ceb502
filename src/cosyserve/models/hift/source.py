"""The neural-source-filter excitation: f0 -> a harmonic sine source (upstream's SineGen2 +
SourceModuleHnNSF2, the variant CosyVoice 2 uses at 24 kHz).

All randomness is explicit: an :class:`Excitation` holds the draws of one call, drawn from a
per-request ``torch.Generator`` (never the global RNG) or given by the caller.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.modeldir.hparams import HiFTConfig


@dataclass(frozen=True)
class Excitation:
    """The random draws of one harmonic-source call.

    ``noise``: (B, H, L) standard normal, one value per sine and output sample; H is the
    number of sines (harmonics + 1), L the number of output samples.

    Upstream also draws a random initial phase per harmonic and adds it at sample 0, but
    its frame-rate phase integration (see :meth:`HarmonicSource._sines`) never reads
    sample 0, so that phase has no effect on the output; we draw it only to keep the
    generator's stream aligned with upstream's.
    """

    noise: Tensor

    @staticmethod
    def draw(
        batch: int, sines: int, samples: int, generator: torch.Generator | Sequence[torch.Generator]
    ) -> "Excitation":
        """Draw from one generator for the whole batch, or from one generator per row.

        The draw order and memory layout are upstream's: ``rand(B, H)`` (the unused initial
        phase) first, then the noise into a (B, L, H) view of (B, H, L) memory. That view is
        what upstream's ``randn_like`` sees, and for such a view torch's CPU kernel takes its
        element-wise (non-vectorised) normal path, so a generator seeded like upstream's
        global RNG yields upstream's exact numbers (on CPU). The element-wise path costs about
        0.1 ms per mel frame, small beside the generator network.
        """
        if isinstance(generator, torch.Generator):
            return _draw(batch, sines, samples, generator)
        if len(generator) != batch:
            raise ValueError(f"got {len(generator)} generators for a batch of {batch}")
        return Excitation(noise=torch.cat([_draw(1, sines, samples, g).noise for g in generator]))


def _draw(batch: int, sines: int, samples: int, generator: torch.Generator) -> Excitation:
    device = generator.device
    torch.rand((batch, sines), generator=generator, device=device)  # upstream's initial phase
    noise = torch.empty((batch, sines, samples), device=device)
    noise.transpose(1, 2).normal_(generator=generator)  # fills the (B, L, H) view, see draw()
    return Excitation(noise=noise)


@dataclass(frozen=True)
class SourceOptions:
    """The NSF source settings (``HiFTConfig``'s ``nsf_*`` fields)."""

    sampling_rate: int
    upsample: int  # output samples per f0 frame
    harmonics: int  # overtones above the fundamental
    sine_amp: float
    noise_std: float
    voiced_threshold: float

    @property
    def sines(self) -> int:
        return self.harmonics + 1

    @classmethod
    def of(cls, cfg: HiFTConfig) -> "SourceOptions":
        return cls(
            sampling_rate=cfg.sampling_rate,
            upsample=cfg.upsample_factor,
            harmonics=cfg.nb_harmonics,
            sine_amp=cfg.nsf_alpha,
            noise_std=cfg.nsf_sigma,
            voiced_threshold=cfg.nsf_voiced_threshold,
        )


class HarmonicSource(nn.Module):
    """f0 (frame rate) -> one excitation channel at the sample rate: 1 + ``harmonics`` sines
    (zeroed where unvoiced) plus Gaussian noise, merged by Linear(H -> 1) and tanh."""

    def __init__(self, options: SourceOptions) -> None:
        super().__init__()
        self.options = options
        self.merge = nn.Linear(options.sines, 1)

    def forward(self, f0: Tensor, excitation: Excitation) -> Tensor:
        """``f0``: (B, T) in Hz -> source: (B, 1, T * upsample)."""
        opt = self.options
        samples = f0.shape[1] * opt.upsample
        expected = (f0.shape[0], opt.sines, samples)
        if excitation.noise.shape != expected:
            raise ValueError(
                f"excitation noise has shape {tuple(excitation.noise.shape)}, expected {expected} "
                f"for f0 of shape {tuple(f0.shape)}"
            )
        # Exact repetition. Upstream's nearest upsampling computes indices in float32 and
        # drifts by one sample after about 21k frames (7 minutes); both agree before that.
        f0_up = f0.repeat_interleave(opt.upsample, dim=1)[:, None]  # (B, 1, L)
        harmonic_numbers = torch.arange(1, opt.sines + 1, dtype=f0.dtype, device=f0.device)
        sines = self._sines(f0_up * harmonic_numbers[:, None]) * opt.sine_amp
        voiced = (f0_up > opt.voiced_threshold).to(f0.dtype)  # (B, 1, L)
        # Unvoiced samples get noise of std sine_amp / 3 (peaks near sine_amp) instead of a sine.
        noise_amp = voiced * opt.noise_std + (1 - voiced) * opt.sine_amp / 3
        mixed = sines * voiced + noise_amp * excitation.noise  # (B, H, L)
        merged: Tensor = self.merge(mixed.transpose(1, 2))  # (B, L, H) -> (B, L, 1)
        return torch.tanh(merged).transpose(1, 2)

    def _sines(self, freqs: Tensor) -> Tensor:
        """``freqs``: (B, H, L) Hz per harmonic and sample -> sin(phase): (B, H, L).

        The phase is integrated at frame rate and interpolated back, as upstream does: the
        per-sample phase increment (in cycles) is linearly downsampled by ``upsample``,
        cumulated, and linearly upsampled (times ``upsample``). The downsampling reads only
        samples upsample/2 - 1 and upsample/2 of each frame (never sample 0, where upstream
        adds its initial phase). The order of operations matches upstream's so that float32
        rounding, which matters at phases of 1e5 rad, is the same.
        """
        opt = self.options
        rad = (freqs / opt.sampling_rate) % 1
        rad = F.interpolate(rad, scale_factor=1 / opt.upsample, mode="linear")  # (B, H, T)
        phase_frames = torch.cumsum(rad, dim=2) * 2 * math.pi
        phase_samples = F.interpolate(phase_frames * opt.upsample, scale_factor=opt.upsample, mode="linear")
        return torch.sin(phase_samples)
