"""Audio output: float model audio to the bytes of a response, streamed or whole.

No web framework is imported here; transports call :func:`create_encoder` per response.
"""

from cosyserve.audio.base import AudioEncoder
from cosyserve.audio.encoders import create_encoder
from cosyserve.audio.formats import (
    MAX_SAMPLE_RATE,
    MIN_SAMPLE_RATE,
    SUPPORTED_FORMATS,
    AudioFormat,
    content_type,
)
from cosyserve.audio.pcm import to_pcm16

__all__ = [
    "MAX_SAMPLE_RATE",
    "MIN_SAMPLE_RATE",
    "SUPPORTED_FORMATS",
    "AudioEncoder",
    "AudioFormat",
    "content_type",
    "create_encoder",
    "to_pcm16",
]
