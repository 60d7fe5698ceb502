"""The causal harmonic source (upstream's SineGen2 + SourceModuleHnNSF with ``causal=True``):
f0 at frame rate -> one excitation channel at the sample rate, one frame at a time.

Differences from CosyVoice 2's source (:mod:`cosyserve.models.hift.source`):

* the phase is integrated at frame rate and held for the whole frame (nearest, not linear,
  upsampling), so a frame's sines need only the f0 of that frame and the running sum of the
  earlier frames' phase increments;
* the noise is not drawn per call: upstream reads a fixed table of uniform [0, 1) values at
  the absolute sample position (drawn once, from the global RNG, when the model is built).
  :func:`noise_window` is our table: blocks of ``NOISE_BLOCK`` samples, each drawn from its
  own seeded generator, so any window of it can be made without the ones before.

The random initial phase upstream adds at sample 0 is never read (the frame-rate
downsampling reads samples 239 and 240 of each 480), so there is none here.
"""

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from cosyserve.models.hift.source import SourceOptions

# Samples per independently seeded block of the noise table (one second at 24 kHz).
NOISE_BLOCK = 24000
_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads (seed, block) pairs over the generator's seeds
_SEED_MASK = (1 << 63) - 1


@functools.lru_cache(maxsize=16)
def _noise_block(seed: int, sines: int, index: int) -> Tensor:
    generator = torch.Generator().manual_seed((seed * _SEED_STRIDE + index) & _SEED_MASK)
    return torch.rand((NOISE_BLOCK, sines), generator=generator)


def noise_window(seed: int, sines: int, start: int, stop: int) -> Tensor:
    """Samples ``start`` .. ``stop`` of the noise table of ``seed``: (stop - start, sines), CPU.
    Read-only (the blocks are cached and shared)."""
    if stop <= start:
        return torch.zeros(0, sines)
    first, last = start // NOISE_BLOCK, (stop - 1) // NOISE_BLOCK
    blocks = [_noise_block(seed, sines, i) for i in range(first, last + 1)]
    joined = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    offset = first * NOISE_BLOCK
    return joined[start - offset : stop - offset]


@dataclass
class SourceState:
    """One stream's source state: frames made so far (the noise table position) and, per
    batch row and sine, the running sum of the phase increments in cycles (float64, the
    accumulator upstream's CPU cumsum keeps, so that a stream rounds like one long call)."""

    frames: int
    cycles: Tensor  # (B, H) float64
    seed: int


class CausalSineSource(nn.Module):
    """f0 -> 1 + ``harmonics`` sines (zeroed where unvoiced) plus table noise, merged by
    Linear(H -> 1) and tanh."""

    def __init__(self, options: SourceOptions) -> None:
        super().__init__()
        self.options = options
        self.merge = nn.Linear(options.sines, 1)

    def new_state(self, batch: int, like: Tensor, seed: int) -> SourceState:
        cycles = torch.zeros(batch, self.options.sines, dtype=torch.float64, device=like.device)
        return SourceState(frames=0, cycles=cycles, seed=seed)

    def step(self, f0: Tensor, state: SourceState) -> Tensor:
        """``f0``: (B, n) in Hz, the stream's next frames -> source: (B, 1, n * upsample)."""
        opt = self.options
        frames = f0.shape[1]
        start = state.frames * opt.upsample
        noise = noise_window(state.seed, opt.sines, start, start + frames * opt.upsample)
        noise = noise.to(f0.device).view(1, frames, opt.upsample, opt.sines)
        harmonic_numbers = torch.arange(1, opt.sines + 1, dtype=f0.dtype, device=f0.device)
        # Per frame and sine: the phase increment in cycles per sample, as upstream rounds it.
        increments = (f0[:, :, None] * harmonic_numbers / opt.sampling_rate) % 1  # (B, n, H)
        # Sequential float64 sums continuing the stream's, rounded to float32 like upstream's.
        running = torch.cat([state.cycles[:, None], increments.to(torch.float64)], dim=1)
        cycles = torch.cumsum(running, dim=1)[:, 1:]
        state.cycles = cycles[:, -1].clone() if frames else state.cycles
        state.frames += frames
        phase = cycles.to(f0.dtype) * 2 * math.pi * opt.upsample  # held for the frame's samples
        sines = torch.sin(phase) * opt.sine_amp  # (B, n, H)
        voiced = (f0 > opt.voiced_threshold).to(f0.dtype)[:, :, None, None]  # (B, n, 1, 1)
        # Unvoiced samples get noise of std sine_amp / 3 (peaks near sine_amp) instead of a sine.
        noise_amp = voiced * opt.noise_std + (1 - voiced) * opt.sine_amp / 3
        mixed = sines[:, :, None, :] * voiced + noise_amp * noise  # (B, n, upsample, H)
        merged: Tensor = self.merge(mixed.flatten(1, 2))  # (B, L, 1)
        return torch.tanh(merged).transpose(1, 2)
