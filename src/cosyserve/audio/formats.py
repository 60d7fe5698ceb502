"""The response formats cosyserve encodes, their MIME types and the sample rates each allows.

MIME types are the IANA-registered ones where they exist: ``audio/mpeg`` (RFC 3003),
``audio/ogg`` (RFC 7845 for Ogg Opus), ``audio/aac`` (ADTS), ``audio/flac``. ``audio/wav``
is what browsers and HTTP clients recognise (the registered ``audio/vnd.wave`` is rarely
used). Raw PCM has no registered type for little-endian samples (``audio/L16`` is
big-endian by definition), so ``pcm`` is ``audio/pcm``, as other TTS servers answer.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from cosyserve.errors import UnsupportedAudioFormatError

AudioFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]

MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000

# Rates in [8000, 48000] that both libmp3lame (MPEG-1/2/2.5 layer III) and the AAC
# sampling-frequency table can signal.
_MPEG_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


@dataclass(frozen=True, slots=True)
class FormatSpec:
    """What one response format needs.

    ``rates``: the sample rates the codec accepts (``None``: any rate in range).
    ``round_up``: when the requested rate is not in ``rates``, encode at the next higher
    one instead of refusing. Only Opus does this: an Ogg Opus decoder plays at 48 kHz
    whatever rate the encoder ran at (RFC 7845 5.1), so the requested rate only bounds
    the audio bandwidth; the other codecs write the rate into the stream and a client
    asking for 20 kHz would silently get something else.
    """

    name: AudioFormat
    content_type: str
    rates: tuple[int, ...] | None
    round_up: bool = False


_FORMATS: Mapping[str, FormatSpec] = MappingProxyType(
    {
        "mp3": FormatSpec("mp3", "audio/mpeg", _MPEG_RATES),
        "opus": FormatSpec("opus", "audio/ogg", _OPUS_RATES, round_up=True),
        "aac": FormatSpec("aac", "audio/aac", _MPEG_RATES),
        "flac": FormatSpec("flac", "audio/flac", None),
        "wav": FormatSpec("wav", "audio/wav", None),
        "pcm": FormatSpec("pcm", "audio/pcm", None),
    }
)

SUPPORTED_FORMATS: tuple[AudioFormat, ...] = ("mp3", "opus", "aac", "flac", "wav", "pcm")


def format_spec(format: str) -> FormatSpec:
    """The spec of ``format``; raises :class:`UnsupportedAudioFormatError` for unknown names."""
    spec = _FORMATS.get(format)
    if spec is None:
        # The message never echoes the (client-supplied) name, so it is stable and safe.
        raise UnsupportedAudioFormatError(
            "unsupported audio format; supported formats: " + ", ".join(SUPPORTED_FORMATS)
        )
    return spec


def content_type(format: str) -> str:
    """The MIME type of a response in ``format``."""
    return format_spec(format).content_type


def encoding_rate(spec: FormatSpec, requested: int) -> int:
    """The sample rate to encode at when the client asks for ``requested`` Hz."""
    # bool is an int subclass; True Hz is not a rate.
    if (
        not isinstance(requested, int)
        or isinstance(requested, bool)
        or not MIN_SAMPLE_RATE <= requested <= MAX_SAMPLE_RATE
    ):
        raise UnsupportedAudioFormatError(
            f"unsupported sample rate; must be an integer from {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz"
        )
    if spec.rates is None or requested in spec.rates:
        return requested
    if spec.round_up:
        return min(rate for rate in spec.rates if rate >= requested)
    raise UnsupportedAudioFormatError(
        f"sample rate {requested} Hz is not supported for {spec.name}; supported rates: "
        + ", ".join(str(rate) for rate in spec.rates)
    )
