"""Streaming vocoding for CosyVoice 3 with per-stream state.

Upstream's ``CosyVoice3Model.token2wav`` keeps every mel frame of a stream and, for each new
chunk, runs the vocoder over all of them (``finalize=False`` until the last chunk), emitting
only the samples past those already emitted: the cost of chunk k grows with k. Because the
vocoder is causal, those samples are fixed once their inputs are: after a non-final call
over M mel frames upstream has emitted ``(M - 8) * 480`` samples (3 frames of f0 look-ahead,
4 of ``conv_pre`` look-ahead, 1 held back), and the final call emits the rest, up to
``M * 480``, with zeros as the last frames' future and a reflected source end.

:class:`CausalHiFTStream` computes each sample once: every convolution keeps its left
context, the look-ahead convolutions their waiting frames, the source its phase sum and
noise-table position, the STFT its unused samples and the iSTFT its overlapping frames.
Pushing chunk k costs what chunk 1 does, and the emitted samples are upstream's, chunk for
chunk (a little more than emitted is computed; the rest waits in the stream).
"""

import torch
from torch import Tensor

from cosyserve.models.hift3.f0 import LOOK_AHEAD
from cosyserve.models.hift3.generator import HELD_FRAMES, CausalHiFTGenerator, DecodeState, ExciteState


class CausalHiFTStream:
    """One request's streaming vocoder (one per request, never shared; not thread-safe).

    ``push(mel, finalize)`` takes the stream's next mel frames (B, n_mels, n) and returns the
    samples they complete, (B, k), clipped like upstream's; after ``finalize`` the stream
    is finished. With ``source`` given in every push (B, 1, L; the pieces joined, the
    excitation of the whole stream, n * 480 samples per mel frame), the stream vocodes
    that excitation instead of making its own.
    """

    def __init__(self, hift: CausalHiFTGenerator, *, batch: int = 1, noise_seed: int = 0) -> None:
        self.hift = hift
        self.batch = batch
        self.noise_seed = noise_seed
        self.frames = 0  # mel frames pushed
        self.emitted = 0  # samples returned
        self.finished = False
        self._excite: ExciteState | None = None
        self._decode: DecodeState | None = None
        self._ready: Tensor | None = None  # samples computed, not yet returned

    @property
    def held_frames(self) -> int:
        """Mel frames at the end whose samples a non-final push does not return."""
        return LOOK_AHEAD + self.hift.cfg.conv_pre_look_right + HELD_FRAMES

    @torch.inference_mode()
    def push(self, mel: Tensor, *, finalize: bool, source: Tensor | None = None) -> Tensor:
        if self.finished:
            raise ValueError("the stream is already finalised")
        if mel.shape[0] != self.batch:
            raise ValueError(f"stream of batch {self.batch} got mel of batch {mel.shape[0]}")
        if self._excite is None or self._decode is None or self._ready is None:
            self._excite = self.hift.new_excite_state(self.batch, mel, self.noise_seed)
            self._decode = self.hift.new_decode_state(self.batch, mel)
            self._ready = mel.new_zeros(self.batch, 0)
        if source is None:
            source = self.hift.excite_step(mel, self._excite, final=finalize)
        new = self.hift.decode_step(mel, source, self._decode, final=finalize)
        ready = torch.cat([self._ready, new], dim=1)
        self.frames += mel.shape[2]
        done = self.frames if finalize else max(0, self.frames - self.held_frames)
        count = done * self.hift.cfg.upsample_factor - self.emitted
        if ready.shape[1] < count:
            raise RuntimeError(f"stream made {ready.shape[1]} samples, {count} are due")  # a bug, not input
        self._ready = ready[:, count:].clone()
        self.emitted += count
        if finalize:
            self.finished = True
            self._excite = self._decode = self._ready = None
        return self.hift.clip(ready[:, :count])
