"""mp3, Ogg Opus, AAC (ADTS) and FLAC through PyAV's bundled FFmpeg, one chunk at a time.

Streamed responses mux into a write-only sink that has no ``seek``: FFmpeg then treats
the output as a pipe, writes each packet as soon as it is muxed, and never goes back to
patch headers. The sink is drained after every chunk, so bytes leave while the model is
still generating. Whole responses mux into a seekable ``BytesIO`` instead, which lets
the muxers finish their headers: the FLAC STREAMINFO gets the total length and MD5, and
the mp3 gets a Xing/LAME frame recording the encoder delay and padding, so decoders
that read it (FFmpeg, mpg123) trim back to the exact length.
"""

import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType

import av
import numpy as np
from av.audio.stream import AudioStream
from av.container import OutputContainer
from numpy.typing import NDArray

from cosyserve.audio.base import AudioEncoder
from cosyserve.audio.pcm import clip_unit, to_pcm16


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """How PyAV encodes one format.

    ``sample_format``: the FFmpeg sample format fed to the codec; float for the lossy
    codecs (no extra quantisation step), s16 for FLAC so that it is lossless with
    respect to the same int16 samples ``wav`` and ``pcm`` carry.
    """

    container: str
    codec: str
    sample_format: str
    bit_rate: int | None = None
    container_options: Mapping[str, str] = field(default_factory=dict)


# Bit rates are common choices for mono speech (a tenth of 24 kHz PCM or less), not tuned
# by listening tests.
_CODECS: Mapping[str, CodecSpec] = MappingProxyType(
    {
        # No ID3v2 tag: the stream is then bare mp3 frames, which any player joins
        # mid-stream and which concatenate cleanly.
        "mp3": CodecSpec("mp3", "libmp3lame", "fltp", 64_000, MappingProxyType({"id3v2_version": "0"})),
        # The Ogg muxer closes a page only after page_duration of audio (default 1 s),
        # which would hold back the first second. One 20 ms Opus packet per page costs
        # about 11 kb/s of page headers but lets every chunk out as soon as it is encoded.
        "opus": CodecSpec("ogg", "libopus", "flt", 32_000, MappingProxyType({"page_duration": "20000"})),
        "aac": CodecSpec("adts", "aac", "fltp", 64_000),
        # FFmpeg reserves 8 KiB of FLAC padding for later metadata edits; nobody edits a
        # response, and it would be the first 8 KiB on the wire.
        "flac": CodecSpec("flac", "flac", "s16", None, MappingProxyType({"metadata_header_padding": "0"})),
    }
)


class _PipeSink:
    """Write-only file for FFmpeg; without ``seek``/``tell`` PyAV opens it as a pipe."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data


class PyAVEncoder(AudioEncoder):
    """One PyAV output container with one mono audio stream."""

    def __init__(
        self, *, format: str, source_rate: int, sample_rate: int, content_type: str, stream: bool
    ) -> None:
        super().__init__(
            source_rate=source_rate, sample_rate=sample_rate, content_type=content_type, stream=stream
        )
        spec = _CODECS[format]
        self._spec = spec
        # Exactly one of the two is set: the pipe for streams, the seekable file otherwise.
        self._sink = _PipeSink() if stream else None
        self._file = None if stream else io.BytesIO()
        options = dict(spec.container_options)
        if stream:
            # Flush FFmpeg's 32 KiB I/O buffer after every packet rather than when full.
            options["flush_packets"] = "1"
        self._container: OutputContainer = av.open(
            self._sink or self._file,
            mode="w",
            format=spec.container,
            options=options,
        )
        try:
            audio = self._container.add_stream(spec.codec, rate=sample_rate)
            if not isinstance(audio, AudioStream):
                raise TypeError(f"{spec.codec} is not an audio codec")
            audio.layout = "mono"
            audio.format = spec.sample_format
            if spec.bit_rate is not None:
                audio.bit_rate = spec.bit_rate
            # Opens the codec (which sets frame_size) and writes the container header.
            self._container.start_encoding()
        except BaseException:
            self._container.close()
            raise
        self._audio = audio
        # Every codec here takes fixed-size frames except that the last may be short
        # (AV_CODEC_CAP_SMALL_LAST_FRAME): the encoder pads that one itself, and formats
        # that can record the true length do (Ogg end granule, FLAC block size, the LAME
        # tag of a whole mp3); ADTS and streamed mp3 end on a zero-padded frame.
        self._frame_size = audio.codec_context.frame_size
        self._pending: list[NDArray[np.float32]] = []
        self._pending_samples = 0
        self._pts = 0
        self._time_base = Fraction(1, sample_rate)

    def _encode(self, samples: NDArray[np.float32]) -> bytes:
        if samples.size:
            self._pending.append(samples)
            self._pending_samples += samples.size
        if self._pending_samples >= self._frame_size:
            buffered = np.concatenate(self._pending)
            whole = buffered.size - buffered.size % self._frame_size
            for start in range(0, whole, self._frame_size):
                self._encode_frame(buffered[start : start + self._frame_size])
            rest = buffered[whole:]
            self._pending = [rest] if rest.size else []
            self._pending_samples = rest.size
        return self._drain()

    def _finish(self) -> bytes:
        if self._pending_samples:
            self._encode_frame(np.concatenate(self._pending))
            self._pending, self._pending_samples = [], 0
        self._mux(self._audio.encode(None))
        # Closing writes the trailer; for whole responses it also rewrites the header.
        self._container.close()
        return self._file.getvalue() if self._file is not None else self._drain()

    def _release(self) -> None:
        # PyAV's close() is idempotent, so this is also safe after _finish().
        self._container.close()
        self._pending.clear()
        if self._file is not None:
            self._file.close()

    def _encode_frame(self, samples: NDArray[np.float32]) -> None:
        planes = (
            to_pcm16(samples).astype(np.int16, copy=False)[np.newaxis, :]
            if self._spec.sample_format == "s16"
            else clip_unit(samples)[np.newaxis, :]
        )
        frame = av.AudioFrame.from_ndarray(planes, format=self._spec.sample_format, layout="mono")
        frame.sample_rate = self.sample_rate
        frame.pts = self._pts
        frame.time_base = self._time_base
        self._pts += samples.size
        self._mux(self._audio.encode(frame))

    # Quoted: av.Packet is generic only in the stubs.
    def _mux(self, packets: "list[av.Packet[AudioStream]]") -> None:
        if packets:
            self._container.mux(packets)

    def _drain(self) -> bytes:
        return self._sink.drain() if self._sink is not None else b""
