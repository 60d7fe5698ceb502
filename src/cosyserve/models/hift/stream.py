"""Streaming vocoding: the per-request caches that make consecutive mel chunks join without
clicks (upstream ``CosyVoice2Model.token2wav``'s hift cache).

Each chunk's mel is prefixed with the previous chunk's last ``mel_cache_frames`` frames, and
the excitation of those frames is the previous call's (``cache_source``), so the harmonic
phase runs on. The first ``overlap`` samples of each new wave are cross-faded with the
previous chunk's last ``overlap`` samples, which were held back (not emitted) for that.
"""

from dataclasses import dataclass, field

import torch
from torch import Tensor

from cosyserve.models.hift.generator import HiFTGenerator


@dataclass(frozen=True)
class StreamOptions:
    """Upstream's values: 8 cached mel frames, 480 samples per frame (3840 = 160 ms overlap)."""

    mel_cache_frames: int = 8
    samples_per_frame: int = 480

    @property
    def overlap(self) -> int:
        """Samples cross-faded and held back per chunk."""
        return self.mel_cache_frames * self.samples_per_frame


@dataclass
class HiFTStreamState:
    """One request's streaming state (one per request, never shared; not thread-safe).

    Use :meth:`prepare` before and :meth:`commit` after ``HiFTGenerator.inference``, or
    :func:`vocode_chunk` for both; the split lets a runner batch the inference of many
    requests between the two.
    """

    options: StreamOptions = field(default_factory=StreamOptions)
    finished: bool = field(default=False, init=False)
    # (B, n_mels, mel_cache_frames): the last frames fed to HiFT; (B, 1, overlap): their
    # excitation; (B, overlap): the held-back tail of the wave.
    _mel: Tensor | None = field(default=None, init=False, repr=False)
    _source: Tensor | None = field(default=None, init=False, repr=False)
    _speech: Tensor | None = field(default=None, init=False, repr=False)

    def prepare(self, mel: Tensor) -> tuple[Tensor, Tensor | None]:
        """New mel frames (B, n_mels, T) -> (HiFT input (B, n_mels, cached + T), cache_source
        (B, 1, overlap) or None for the first chunk)."""
        if self.finished:
            raise ValueError("the stream is already finalised")
        if self._mel is None:
            return mel, None
        return torch.cat([self._mel, mel], dim=2), self._source

    def commit(self, hift_mel: Tensor, wave: Tensor, source: Tensor, *, finalize: bool) -> Tensor:
        """Take the HiFT output for ``hift_mel`` (the input :meth:`prepare` returned) and
        return the samples to emit, (B, N).

        ``wave``: (B, L); ``source``: (B, 1, L). A non-final chunk emits all but its last
        ``overlap`` samples; the final chunk emits everything and ends the stream.
        """
        if self.finished:
            raise ValueError("the stream is already finalised")
        opt = self.options
        if self._speech is not None:
            wave = _crossfade(wave, self._speech)
        if finalize:
            self.finished = True
            self._mel = self._source = self._speech = None
            return wave
        if hift_mel.shape[2] < opt.mel_cache_frames:
            raise ValueError(
                f"a non-final chunk needs at least {opt.mel_cache_frames} mel frames, got {hift_mel.shape[2]}"
            )
        # Clones, so the caches do not pin the whole chunk's tensors.
        self._mel = hift_mel[:, :, -opt.mel_cache_frames :].clone()
        self._source = source[:, :, -opt.overlap :].clone()
        self._speech = wave[:, -opt.overlap :].clone()
        return wave[:, : -opt.overlap]


def _crossfade(wave: Tensor, tail: Tensor) -> Tensor:
    """Fade ``wave``'s first n samples in over the previous ``tail`` (B, n) fading out, with
    the two halves of a symmetric Hamming window of 2n. Computed in float64 like upstream's
    numpy window arithmetic, then rounded back."""
    n = tail.shape[-1]
    window = torch.hamming_window(2 * n, periodic=False, dtype=torch.float64, device=wave.device)
    head = wave[:, :n].double() * window[:n] + tail.double() * window[n:]
    return torch.cat([head.to(wave.dtype), wave[:, n:]], dim=1)


def vocode_chunk(
    hift: HiFTGenerator,
    state: HiFTStreamState,
    mel: Tensor,
    *,
    finalize: bool,
    generator: torch.Generator,
) -> Tensor:
    """One streaming step for one request: new mel frames (B, n_mels, T) -> samples to emit (B, N)."""
    if state.options.samples_per_frame != hift.cfg.upsample_factor:
        raise ValueError(
            f"stream options assume {state.options.samples_per_frame} samples per frame, "
            f"the vocoder makes {hift.cfg.upsample_factor}"
        )
    hift_mel, cache_source = state.prepare(mel)
    wave, source = hift.inference(hift_mel, cache_source, generator=generator)
    return state.commit(hift_mel, wave, source, finalize=finalize)
