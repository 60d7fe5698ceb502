"""The vocoder's STFT of the source and inverse STFT of its output, run step by step.

Both are upstream's ``torch.stft`` / ``torch.istft`` with ``center=True``: the signal is
reflect-padded by ``n_fft / 2`` at both ends, and the inverse drops ``n_fft / 2`` samples at
both ends. Step by step, the start is padded (or dropped) in the first step and the end in
the final one; in between, frame ``f`` is made once samples ``hop * f - n_fft / 2`` ..
``hop * f + n_fft / 2`` exist, and an output sample is released once every frame
overlapping it has been added (the window envelope it is divided by is then complete too).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Frames:
    """STFT geometry: frame length (= window length) and hop, in samples."""

    n_fft: int
    hop: int

    @property
    def half(self) -> int:
        return self.n_fft // 2

    @property
    def overlap(self) -> int:
        """Frames covering one sample (4 for 16 / 4)."""
        return self.n_fft // self.hop


@dataclass
class AnalysisState:
    """Samples not yet fully used by a frame, in padded coordinates; before the first frame,
    the raw samples waiting to be enough for the start's reflection."""

    pending: Tensor  # (B, n)
    started: bool = False


def stft_step(
    samples: Tensor, state: AnalysisState, window: Tensor, geometry: Frames, *, final: bool
) -> Tensor:
    """New samples (B, n) -> new frames, real and imaginary parts on channels:
    (B, n_fft + 2, m). ``final`` reflects the end, making the last frames."""
    half = geometry.half
    buffer = torch.cat([state.pending, samples], dim=1)
    if not state.started:
        if buffer.shape[1] <= half and not final:
            state.pending = buffer
            return buffer.new_zeros(buffer.shape[0], geometry.n_fft + 2, 0)
        buffer = torch.cat([buffer[:, 1 : half + 1].flip(1), buffer], dim=1)
        state.started = True
    if final:
        buffer = torch.cat([buffer, buffer[:, -half - 1 : -1].flip(1)], dim=1)
    count = (buffer.shape[1] - geometry.n_fft) // geometry.hop + 1 if buffer.shape[1] >= geometry.n_fft else 0
    state.pending = buffer[:, count * geometry.hop :].clone()
    if count == 0:
        return buffer.new_zeros(buffer.shape[0], geometry.n_fft + 2, 0)
    used = buffer[:, : (count - 1) * geometry.hop + geometry.n_fft]
    spec = torch.stft(
        used, geometry.n_fft, geometry.hop, geometry.n_fft, window=window, center=False, return_complex=True
    )
    return torch.cat([spec.real, spec.imag], dim=1)


@dataclass
class SynthesisState:
    """The last ``overlap - 1`` windowed frames, (B, n_fft, <= overlap - 1), and the output
    samples still to drop at the start."""

    tail: Tensor
    to_drop: int


def new_synthesis_state(batch: int, like: Tensor, geometry: Frames) -> SynthesisState:
    return SynthesisState(tail=like.new_zeros(batch, geometry.n_fft, 0), to_drop=geometry.half)


def istft_step(
    spec: Tensor, state: SynthesisState, window: Tensor, geometry: Frames, *, final: bool
) -> Tensor:
    """New complex frames (B, n_fft / 2 + 1, m) -> the output samples they complete (B, k).

    Overlap-add by hops: the ``hop`` samples starting at frame ``g``'s position are the sum,
    over ``q`` < ``overlap``, of part ``q`` of frame ``g - q``, divided by the sum of the
    squared window parts of the frames that exist. ``final`` completes the last hop that
    upstream keeps (``center=True`` drops the rest)."""
    hop, parts = geometry.hop, geometry.overlap
    if spec.shape[2]:
        frames = torch.fft.irfft(spec, n=geometry.n_fft, dim=1) * window[:, None]  # (B, n_fft, m)
    else:  # the FFT rejects empty inputs
        frames = state.tail.new_zeros(spec.shape[0], geometry.n_fft, 0)
    real = torch.cat([state.tail, frames], dim=2)
    state.tail = real[:, :, max(0, real.shape[2] - (parts - 1)) :].clone()
    # Column parts - 1 + j holds the j-th new frame; absent frames (before the first, after
    # the last) are zeros that do not count in the envelope.
    absent_before = parts - 1 - (real.shape[2] - frames.shape[2])
    hops = frames.shape[2] + (1 if final else 0)  # final: the hop after the last frame
    joined = F.pad(real, (absent_before, hops - frames.shape[2]))
    present = F.pad(real.new_ones(real.shape[2]), (absent_before, hops - frames.shape[2]))
    squared = window * window
    total = joined.new_zeros(joined.shape[0], hop, hops)
    envelope = joined.new_zeros(hop, hops)
    for q in reversed(range(parts)):
        columns = slice(parts - 1 - q, parts - 1 - q + hops)
        total = total + joined[:, q * hop : (q + 1) * hop, columns]
        envelope = envelope + squared[q * hop : (q + 1) * hop, None] * present[columns]
    samples = (total / envelope).transpose(1, 2).reshape(joined.shape[0], hops * hop)
    drop = min(state.to_drop, samples.shape[1])
    state.to_drop -= drop
    return samples[:, drop:]
