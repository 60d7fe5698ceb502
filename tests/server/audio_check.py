"""Decoding server responses with independent decoders (libsndfile, FFmpeg via PyAV)."""

import io
from dataclasses import dataclass

import av
import numpy as np
import soundfile as sf

# One CosyVoice 2 speech token is 40 ms of audio (25 Hz).
SECONDS_PER_TOKEN = 0.04


@dataclass(frozen=True)
class Decoded:
    sample_rate: int
    channels: int
    samples: int

    @property
    def duration(self) -> float:
        return self.samples / self.sample_rate


def decode(data: bytes, response_format: str, pcm_rate: int = 24000) -> Decoded:
    """Decode a whole response body; ``pcm`` is raw 16-bit mono at ``pcm_rate``."""
    if response_format == "pcm":
        assert len(data) % 2 == 0
        return Decoded(pcm_rate, 1, len(data) // 2)
    if response_format in ("wav", "flac"):
        info = sf.info(io.BytesIO(data))
        samples = len(sf.read(io.BytesIO(data), dtype="float32")[0])
        return Decoded(info.samplerate, info.channels, samples)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate
        channels = stream.codec_context.channels
        samples = sum(frame.samples for frame in container.decode(stream))
    return Decoded(rate, channels, samples)


def pcm16(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2")
