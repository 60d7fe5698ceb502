"""Choosing and building the encoder for one response."""

from cosyserve.audio.base import AudioEncoder
from cosyserve.audio.formats import encoding_rate, format_spec
from cosyserve.audio.pcm import PcmEncoder
from cosyserve.audio.pyav_encoder import PyAVEncoder
from cosyserve.audio.wav import WavEncoder


def create_encoder(
    format: str, source_rate: int, target_rate: int | None = None, *, stream: bool = True
) -> AudioEncoder:
    """An encoder for one response in ``format`` (one of ``SUPPORTED_FORMATS``).

    ``source_rate`` is the rate of the chunks fed to it (the model's, 24 kHz for
    CosyVoice 2); ``target_rate`` is the rate the client asked for, ``None`` for the
    source rate. Opus encodes at the next rate it supports at or above the requested
    one; :attr:`AudioEncoder.sample_rate` tells the rate actually encoded.

    Raises :class:`~cosyserve.errors.UnsupportedAudioFormatError` for an unknown format
    or a sample rate the format cannot carry. Building an encoder is cheap, so a
    transport can call this to validate a request before synthesis starts.
    """
    spec = format_spec(format)
    if isinstance(source_rate, bool) or not isinstance(source_rate, int) or source_rate <= 0:
        # The source rate comes from the model, not the client: a bad one is a bug here.
        raise ValueError(f"source_rate must be a positive integer, got {source_rate!r}")
    sample_rate = encoding_rate(spec, source_rate if target_rate is None else target_rate)
    if spec.name == "pcm":
        return PcmEncoder(
            source_rate=source_rate, sample_rate=sample_rate, content_type=spec.content_type, stream=stream
        )
    if spec.name == "wav":
        return WavEncoder(
            source_rate=source_rate, sample_rate=sample_rate, content_type=spec.content_type, stream=stream
        )
    return PyAVEncoder(
        format=spec.name,
        source_rate=source_rate,
        sample_rate=sample_rate,
        content_type=spec.content_type,
        stream=stream,
    )
