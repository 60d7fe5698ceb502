"""Streaming encoders, checked by decoding their output with decoders outside the encoding path.

wav, whole flac and Ogg Opus are decoded by libsndfile (soundfile); mp3, AAC and
streamed FLAC by FFmpeg's decoders through PyAV (libsndfile cannot read a FLAC whose
STREAMINFO leaves the length open, as a streamed one must); pcm by numpy.

Length tolerances for the lossy codecs, at the encoded rate:
- mp3 streamed: LAME's encoder delay plus padding to a whole frame, up to two frames
  (2 x 1152 samples) more than the input; nothing records them on a pipe. Whole mp3
  files carry a LAME tag, and FFmpeg then trims to the exact length.
- AAC (ADTS): 1024 priming samples plus padding to a 1024-sample frame, up to 2048
  more; ADTS has no field for either.
- Opus: exact. The Ogg header's pre-skip and the last page's granule position trim both.
"""

import io
import struct
from collections.abc import Iterator, Sequence

import av
import numpy as np
import pytest
import soundfile as sf
from numpy.typing import NDArray

from cosyserve.audio import (
    SUPPORTED_FORMATS,
    AudioEncoder,
    content_type,
    create_encoder,
)
from cosyserve.errors import InvalidRequestError, UnsupportedAudioFormatError

SR = 24000
LOSSLESS = ("wav", "pcm", "flac")
LOSSY = ("mp3", "opus", "aac")
# Extra samples (at the encoded rate) a decoder may return beyond the input (module docstring).
EXTRA = {"mp3": 2 * 1152, "aac": 2048, "opus": 0}
IRREGULAR = (0, 1, 7, 480, 2401, 3, 12000, 960)


def _signal(seconds: float, rate: int = SR, amplitude: float = 0.5) -> NDArray[np.float32]:
    """A 220 Hz tone with a little noise: tonal enough to correlate, noisy enough to stress codecs."""
    rng = np.random.default_rng(1234)
    t = np.arange(round(seconds * rate)) / rate
    x = amplitude * np.sin(2 * np.pi * 220 * t) + 0.02 * rng.standard_normal(t.size)
    return x.astype(np.float32)


def _chunks(x: NDArray[np.float32], sizes: Sequence[int]) -> Iterator[NDArray[np.float32]]:
    start, k = 0, 0
    while start < x.size:
        size = sizes[k % len(sizes)]
        yield x[start : start + size]
        start, k = start + size, k + 1


def _run(encoder: AudioEncoder, x: NDArray[np.float32], sizes: Sequence[int]) -> tuple[list[bytes], bytes]:
    with encoder:
        parts = [encoder.encode(chunk) for chunk in _chunks(x, sizes)]
        return parts, encoder.finish()


def _encode(fmt: str, x: NDArray[np.float32], *, stream: bool = True, target: int | None = None) -> bytes:
    parts, tail = _run(create_encoder(fmt, SR, target, stream=stream), x, IRREGULAR)
    if not stream:
        assert not any(parts), "a whole-response encoder returns nothing before finish()"
    return b"".join(parts) + tail


def _quantised(x: NDArray[np.float32]) -> NDArray[np.int16]:
    # Written out here rather than imported, so the test restates the scaling contract.
    return np.round(np.clip(x, -1.0, 1.0) * 32767).astype(np.int16)


def _decode_pyav(data: bytes) -> tuple[NDArray[np.float32], int, int]:
    """(samples of the first channel as float, sample rate, channel count) via FFmpeg's decoders."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray() for frame in container.decode(stream)]
        rate, channels = stream.codec_context.sample_rate, stream.codec_context.channels
    pcm = np.concatenate(frames, axis=1)
    if pcm.dtype == np.int16:
        return pcm[0].astype(np.float32) / 32768, rate, channels
    return pcm[0].astype(np.float32), rate, channels


def _decode_soundfile(data: bytes, dtype: str = "int16") -> tuple[NDArray[np.generic], int, int]:
    samples, rate = sf.read(io.BytesIO(data), dtype=dtype, always_2d=True)
    return samples[:, 0], rate, samples.shape[1]


def _align(ref: NDArray[np.float32], decoded: NDArray[np.float32], max_lag: int) -> tuple[float, int]:
    """(highest normalised correlation, its lag) of ``decoded`` against ``ref`` delayed 0..max_lag."""
    n = ref.size
    scores = [
        float(np.dot(ref, seg) / (np.linalg.norm(ref) * np.linalg.norm(seg) + 1e-12))
        for lag in range(max_lag + 1)
        if (seg := decoded[lag : lag + n]).size == n
    ]
    lag = int(np.argmax(scores))
    return scores[lag], lag


# --- lossless formats: exact samples ---------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("fmt", LOSSLESS)
def test_lossless_formats_carry_the_int16_quantised_input(fmt: str, stream: bool) -> None:
    x = _signal(1.5)
    data = _encode(fmt, x, stream=stream)
    if fmt == "pcm":
        samples, rate, channels = np.frombuffer(data, dtype="<i2"), SR, 1
    elif fmt == "flac" and stream:
        decoded, rate, channels = _decode_pyav(data)
        samples = np.round(decoded * 32768).astype(np.int16)
    else:
        samples, rate, channels = _decode_soundfile(data)
    assert (rate, channels) == (SR, 1)
    np.testing.assert_array_equal(samples, _quantised(x))


def test_wav_headers_streamed_open_ended_and_whole_exact() -> None:
    x = _signal(0.25)
    streamed, whole = _encode("wav", x), _encode("wav", x, stream=False)
    assert streamed[44:] == whole[44:] == _quantised(x).astype("<i2").tobytes()
    riff, fmt_rate, data_size = (
        struct.unpack_from("<I", streamed, 4)[0],
        struct.unpack_from("<I", streamed, 24)[0],
        struct.unpack_from("<I", streamed, 40)[0],
    )
    assert (riff, fmt_rate, data_size) == (0xFFFFFFFF, SR, 0xFFFFFFFF)
    assert struct.unpack_from("<I", whole, 4)[0] == 36 + 2 * x.size
    assert struct.unpack_from("<I", whole, 40)[0] == 2 * x.size


def test_pcm_scaling_clips_instead_of_wrapping() -> None:
    x = np.array([1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, np.nan, np.inf, -np.inf], dtype=np.float32)
    encoder = create_encoder("pcm", SR)
    samples = np.frombuffer(encoder.encode(x) + encoder.finish(), dtype="<i2")
    assert samples.tolist() == [32767, 32767, 16384, 0, -16384, -32767, -32767, 0, 32767, -32767]


@pytest.mark.parametrize("fmt", LOSSLESS)
def test_lossless_clip_at_1_5_does_not_wrap(fmt: str) -> None:
    x = _signal(0.5, amplitude=1.5)
    data = _encode(fmt, x, stream=False)
    samples = np.frombuffer(data, dtype="<i2") if fmt == "pcm" else _decode_soundfile(data)[0]
    np.testing.assert_array_equal(samples, _quantised(x))
    assert samples.max() == 32767 and samples.min() == -32767


# --- lossy formats: rate, channels, length, content --------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("fmt", LOSSY)
def test_lossy_formats_decode_to_the_input(fmt: str, stream: bool) -> None:
    x = _signal(1.5)
    decoded, rate, channels = _decode_pyav(_encode(fmt, x, stream=stream))
    # FFmpeg decodes Opus at 48 kHz whatever rate it was encoded at.
    expected_rate = 48000 if fmt == "opus" else SR
    expected_len = x.size * expected_rate // SR
    assert (rate, channels) == (expected_rate, 1)
    exact = fmt == "opus" or (fmt == "mp3" and not stream)
    extra = 0 if exact else EXTRA[fmt]
    assert expected_len <= decoded.size <= expected_len + extra
    ref = x if rate == SR else np.repeat(x, rate // SR)  # crude upsampling is enough to correlate
    assert _align(ref[: ref.size - 4096], decoded, 4096)[0] > 0.95


def test_opus_decodes_with_libsndfile_too() -> None:
    x = _signal(1.0)
    samples, rate, channels = _decode_soundfile(_encode("opus", x), dtype="float32")
    # libsndfile plays Ogg Opus at the rate recorded in its header.
    assert (rate, channels, samples.size) == (SR, 1, x.size)


@pytest.mark.parametrize("fmt", LOSSY)
def test_lossy_clip_at_1_5_does_not_wrap(fmt: str) -> None:
    x = _signal(1.0, amplitude=1.5)
    decoded, rate, _ = _decode_pyav(_encode(fmt, x))
    step = rate // SR  # crude upsampling of the references is enough to compare
    clipped = np.repeat(np.clip(x, -1.0, 1.0), step)[: -4096 * step]
    unclipped = np.repeat(x, step)[: -4096 * step]
    corr, lag = _align(clipped, decoded, 4096)
    decoded = decoded[lag : lag + clipped.size]
    # Wrapped samples would flip sign at every peak and wreck the correlation; the
    # decoded signal must be the clipped input, not the unclipped one. (The codecs'
    # own Gibbs overshoot on the flattened peaks is expected, so no peak bound.)
    assert corr > 0.95
    assert np.linalg.norm(decoded - clipped) < 0.7 * np.linalg.norm(decoded - unclipped)


# --- streaming behaviour --------------------------------------------------------------------


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_streamed_bytes_arrive_before_finish(fmt: str) -> None:
    # 6 s of audio in 0.5 s chunks, as the model streams it.
    parts, tail = _run(create_encoder(fmt, SR), _signal(6.0), [SR // 2])
    assert parts[0], "the first chunk must already produce bytes"
    early = sum(len(p) for p in parts)
    assert early > 0.9 * (early + len(tail))


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_tiny_and_empty_chunks(fmt: str) -> None:
    x = _signal(0.2)
    encoder = create_encoder(fmt, SR)
    parts = [encoder.encode(np.zeros(0, dtype=np.float32))]
    parts += [encoder.encode(x[i : i + 1]) for i in range(x.size)]
    parts.append(encoder.encode(np.zeros(0, dtype=np.float32)))
    data = b"".join(parts) + encoder.finish()
    if fmt == "pcm":
        assert len(data) == 2 * x.size
        return
    decoded, rate, _ = _decode_pyav(data)
    expected = x.size * rate // SR
    assert expected <= decoded.size <= expected + EXTRA.get(fmt, 0)


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_finish_without_audio(fmt: str) -> None:
    # A request that produced no audio ends with a header-only body, or none where the
    # format has no header (a zero-length mp3/AAC/pcm body is a valid empty stream).
    encoder = create_encoder(fmt, SR)
    data = encoder.encode(np.zeros(0, dtype=np.float32)) + encoder.finish()
    if fmt in ("mp3", "aac", "pcm"):
        assert data == b""
    elif fmt == "wav":
        assert _decode_soundfile(data)[0].size == 0
    elif fmt == "opus":
        assert data.startswith(b"OggS") and b"OpusHead" in data and b"OpusTags" in data
    else:
        with av.open(io.BytesIO(data)) as container:
            assert sum(frame.samples for frame in container.decode(audio=0)) == 0


@pytest.mark.parametrize("target", [8000, 16000, 22050, 44100, 48000])
def test_resampling_is_independent_of_chunking(target: int) -> None:
    # The resampler keeps its filter state across chunks: no seams, same samples.
    x = _signal(0.5)
    irregular = _encode("pcm", x, target=target)
    single, tail = _run(create_encoder("pcm", SR, target), x, [x.size])
    assert irregular == b"".join(single) + tail


@pytest.mark.parametrize("target", [8000, 16000, 22050, 44100, 48000])
@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_resampling_gives_the_right_rate_and_duration(fmt: str, target: int) -> None:
    x = _signal(1.0)
    encoder = create_encoder(fmt, SR, target)
    parts, tail = _run(encoder, x, IRREGULAR)
    data = b"".join(parts) + tail
    if fmt == "pcm":
        rate, length = target, len(data) // 2
    elif fmt == "wav":
        samples, rate, _ = _decode_soundfile(data)
        length = samples.size
    else:
        decoded, rate, _ = _decode_pyav(data)
        length = decoded.size
    # Opus encodes at the next Opus rate up and FFmpeg decodes it at 48 kHz.
    expected_encoded = {22050: 24000, 44100: 48000}.get(target, target) if fmt == "opus" else target
    assert encoder.sample_rate == expected_encoded
    assert rate == (48000 if fmt == "opus" else target)
    expected = round(x.size * target / SR) * rate // target
    assert expected - 1 <= length <= expected + 1 + EXTRA.get(fmt, 0)


# --- API surface and errors ---------------------------------------------------------------


def test_content_types() -> None:
    assert {fmt: content_type(fmt) for fmt in SUPPORTED_FORMATS} == {
        "mp3": "audio/mpeg",
        "opus": "audio/ogg",
        "aac": "audio/aac",
        "flac": "audio/flac",
        "wav": "audio/wav",
        "pcm": "audio/pcm",
    }
    assert create_encoder("opus", SR).content_type == "audio/ogg"


@pytest.mark.parametrize("fmt", ["ogg", "MP3", "vorbis", "", "wav "])
def test_unsupported_format_has_a_stable_message(fmt: str) -> None:
    with pytest.raises(UnsupportedAudioFormatError) as info:
        create_encoder(fmt, SR)
    assert str(info.value) == "unsupported audio format; supported formats: mp3, opus, aac, flac, wav, pcm"
    assert isinstance(info.value, InvalidRequestError)
    assert info.value.code == "unsupported_audio_format"
    with pytest.raises(UnsupportedAudioFormatError):
        content_type(fmt)


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
@pytest.mark.parametrize("rate", [7999, 48001, 96000, 0, -8000, True, 22050.0])
def test_out_of_range_sample_rate_has_a_stable_message(fmt: str, rate: int) -> None:
    with pytest.raises(UnsupportedAudioFormatError, match=r"^unsupported sample rate; must be an integer"):
        create_encoder(fmt, SR, rate)


@pytest.mark.parametrize("fmt", ["mp3", "aac"])
def test_rate_the_codec_cannot_signal_is_refused(fmt: str) -> None:
    with pytest.raises(UnsupportedAudioFormatError) as info:
        create_encoder(fmt, SR, 20000)
    assert str(info.value) == (
        f"sample rate 20000 Hz is not supported for {fmt}; "
        "supported rates: 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000"
    )


@pytest.mark.parametrize(("fmt", "rate"), [("wav", 20000), ("pcm", 9999), ("flac", 37000), ("opus", 20000)])
def test_any_in_range_rate_works_where_the_codec_allows(fmt: str, rate: int) -> None:
    encoder = create_encoder(fmt, SR, rate)
    assert encoder.sample_rate == (24000 if fmt == "opus" else rate)
    encoder.close()


@pytest.mark.parametrize("rate", [0, -1, True])
def test_bad_source_rate_is_a_programming_error(rate: int) -> None:
    with pytest.raises(ValueError, match="source_rate"):
        create_encoder("wav", rate)


def test_chunk_validation() -> None:
    with create_encoder("pcm", SR) as encoder:
        assert len(encoder.encode(np.zeros((1, 10), dtype=np.float32))) == 20  # (1, n) is mono
        assert len(encoder.encode(np.zeros(10, dtype=np.float64))) == 20
        with pytest.raises(TypeError):
            encoder.encode(np.zeros(10, dtype=np.int16))
        with pytest.raises(ValueError):
            encoder.encode(np.zeros((2, 10), dtype=np.float32))


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
def test_close_midstream_and_reuse_after_close(fmt: str) -> None:
    # A client disconnect: the transport closes without finishing.
    with create_encoder(fmt, SR) as encoder:
        encoder.encode(_signal(0.3))
    encoder.close()  # idempotent
    with pytest.raises(RuntimeError):
        encoder.encode(_signal(0.1))
    with pytest.raises(RuntimeError):
        encoder.finish()
    finished = create_encoder(fmt, SR)
    finished.finish()
    with pytest.raises(RuntimeError):
        finished.finish()
