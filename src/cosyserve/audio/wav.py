"""16-bit mono WAV, streamed with an open-ended header or whole with exact sizes.

A streamed response's length is unknown when the header goes out, so the RIFF and data
chunk sizes are 0xFFFFFFFF, the value FFmpeg writes to non-seekable outputs and that
libsndfile, FFmpeg, browsers and Python's ``wave`` (which reads until EOF) accept as
"until the end of the stream". Whole (non-streamed) responses carry the exact sizes.
"""

import struct

import numpy as np
from numpy.typing import NDArray

from cosyserve.audio.pcm import PcmEncoder

UNKNOWN_SIZE = 0xFFFFFFFF
_HEADER_BYTES = 44


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte PCM WAV header; ``data_bytes=None`` writes the streaming sizes."""
    if data_bytes is None:
        riff_size = data_size = UNKNOWN_SIZE
    else:
        data_size = data_bytes
        riff_size = _HEADER_BYTES - 8 + data_bytes
    channels, sample_bytes = 1, 2
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        riff_size,
        b"WAVE",
        b"fmt ",
        16,  # fmt chunk size for plain PCM
        1,  # WAVE_FORMAT_PCM
        channels,
        sample_rate,
        sample_rate * channels * sample_bytes,  # byte rate
        channels * sample_bytes,  # block align
        8 * sample_bytes,
        b"data",
        data_size,
    )


class WavEncoder(PcmEncoder):
    """PCM samples behind a WAV header: sent ahead of the first bytes, or exact at the end."""

    def __init__(self, *, source_rate: int, sample_rate: int, content_type: str, stream: bool) -> None:
        super().__init__(
            source_rate=source_rate, sample_rate=sample_rate, content_type=content_type, stream=stream
        )
        self._header_sent = False

    def _streaming_header(self) -> bytes:
        if self._header_sent:
            return b""
        self._header_sent = True
        return wav_header(self.sample_rate, None)

    def _encode(self, samples: NDArray[np.float32]) -> bytes:
        data = super()._encode(samples)
        # The header goes out with the first call even when it brings no samples, so a
        # client sees a valid stream as soon as the response starts.
        return self._streaming_header() + data if self.stream else data

    def _finish(self) -> bytes:
        data = super()._finish()
        if self.stream:
            return self._streaming_header() + data
        return wav_header(self.sample_rate, self.data_bytes) + data
