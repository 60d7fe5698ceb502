"""Float to 16-bit PCM, and the raw ``pcm`` format.

Scaling: samples are clipped to [-1, 1], multiplied by 32767 and rounded to the nearest
integer, so +1.0 -> 32767 and -1.0 -> -32767. Upstream CosyVoice computes
``(audio * 2**15).astype(int16)`` without clipping, which maps +1.0 to -32768 and wraps
any overshoot (the vocoder does overshoot) into loud clicks; we clip instead, and use
32767 so that the scale is symmetric. Output is little-endian whatever the host order.
"""

import numpy as np
from numpy.typing import NDArray

from cosyserve.audio.base import AudioEncoder

PCM16_SCALE = 32767.0


def clip_unit(samples: NDArray[np.float32]) -> NDArray[np.float32]:
    """``samples`` with NaN as silence and everything clipped to [-1, 1]."""
    # A NaN would otherwise reach int16 conversion, whose result is undefined.
    cleaned = np.nan_to_num(samples, nan=0.0, posinf=1.0, neginf=-1.0)
    clipped: NDArray[np.float32] = np.clip(cleaned, -1.0, 1.0).astype(np.float32, copy=False)
    return clipped


def to_pcm16(samples: NDArray[np.float32]) -> NDArray[np.int16]:
    """Quantise float audio to int16 as described in the module docstring."""
    pcm: NDArray[np.int16] = np.rint(clip_unit(samples) * PCM16_SCALE).astype("<i2")
    return pcm


class PcmEncoder(AudioEncoder):
    """Raw little-endian int16 mono with no header; streamed and whole responses are the same bytes."""

    def __init__(self, *, source_rate: int, sample_rate: int, content_type: str, stream: bool) -> None:
        super().__init__(
            source_rate=source_rate, sample_rate=sample_rate, content_type=content_type, stream=stream
        )
        self._held: list[bytes] = []
        self.data_bytes = 0

    def _encode(self, samples: NDArray[np.float32]) -> bytes:
        data = to_pcm16(samples).tobytes()
        self.data_bytes += len(data)
        if self.stream:
            return data
        self._held.append(data)
        return b""

    def _finish(self) -> bytes:
        data = b"".join(self._held)
        self._held.clear()
        return data

    def _release(self) -> None:
        self._held.clear()
