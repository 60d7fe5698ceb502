"""Prompt audio decoding, validation and resampling."""

import io
from pathlib import Path

import av
import numpy as np
import pytest
import soundfile as sf

from cosyserve.errors import InvalidRequestError, PromptAudioError
from cosyserve.frontend.audio import (
    PromptAudioLimits,
    load_audio,
    load_prompt_audio,
    resample,
    validate_prompt_audio,
)

LIMITS = PromptAudioLimits()


def _tone(sample_rate: int, seconds: float, channels: int = 1, seed: int = 0) -> np.ndarray:
    """(N, channels) float32: a 220 Hz tone (scaled per channel) plus a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(sample_rate * seconds)) / sample_rate
    tone = 0.4 * np.sin(2 * np.pi * 220.0 * t)
    columns = [tone * (1.0 - 0.3 * c) + 0.01 * rng.standard_normal(t.size) for c in range(channels)]
    return np.stack(columns, axis=1).astype(np.float32)


def _encode_soundfile(frames: np.ndarray, sample_rate: int, fmt: str, subtype: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, frames, sample_rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def _encode_pyav(frames: np.ndarray, sample_rate: int, container: str, codec: str) -> bytes:
    buf = io.BytesIO()
    layout = "mono" if frames.shape[1] == 1 else "stereo"
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=sample_rate, layout=layout)
        assert isinstance(stream, av.AudioStream)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(frames.T), format="fltp", layout=layout)
        frame.sample_rate = sample_rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def _snr_db(reference: np.ndarray, decoded: np.ndarray) -> float:
    n = min(reference.size, decoded.size)
    noise = np.sum((reference[:n] - decoded[:n]) ** 2, dtype=np.float64)
    return float(10 * np.log10(np.sum(reference[:n] ** 2, dtype=np.float64) / max(noise, 1e-30)))


@pytest.mark.parametrize("sample_rate", [16000, 22050, 24000, 44100, 48000])
@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize(
    ("fmt", "subtype", "min_snr_db"),
    [("WAV", "PCM_16", 60.0), ("WAV", "FLOAT", 120.0), ("FLAC", "PCM_24", 90.0), ("OGG", "VORBIS", 20.0)],
)
def test_soundfile_formats_decode_to_mono_mean(
    sample_rate: int, channels: int, fmt: str, subtype: str, min_snr_db: float
) -> None:
    frames = _tone(sample_rate, 1.0, channels)
    wav, sr = load_audio(_encode_soundfile(frames, sample_rate, fmt, subtype))
    assert sr == sample_rate
    assert wav.dtype == np.float32 and wav.ndim == 1
    assert wav.shape[0] == frames.shape[0]
    assert _snr_db(frames.mean(axis=1), wav) > min_snr_db


@pytest.mark.parametrize("sample_rate", [16000, 24000, 44100, 48000])
@pytest.mark.parametrize("channels", [1, 2])
def test_mp3_from_pyav_decodes(sample_rate: int, channels: int) -> None:
    frames = _tone(sample_rate, 1.0, channels)
    wav, sr = load_audio(_encode_pyav(frames, sample_rate, "mp3", "libmp3lame"))
    assert sr == sample_rate
    # MP3 frames are 1152 samples; the decoder may pad the tail.
    assert abs(wav.shape[0] - frames.shape[0]) <= 1152
    assert _snr_db(frames.mean(axis=1), wav) > 10.0


def test_format_soundfile_cannot_read_goes_through_pyav() -> None:
    frames = _tone(24000, 1.0, 2)
    data = _encode_pyav(frames, 24000, "adts", "aac")
    with pytest.raises(sf.LibsndfileError):
        sf.info(io.BytesIO(data))
    wav, sr = load_audio(data)
    assert sr == 24000
    assert abs(wav.shape[0] - 24000) <= 2048
    # AAC delays the signal by its 1024-sample priming; compare energy, not samples.
    assert np.sqrt(np.mean(wav**2)) == pytest.approx(np.sqrt(np.mean(frames.mean(axis=1) ** 2)), rel=0.1)


def test_multichannel_is_the_channel_mean(tmp_path: Path) -> None:
    frames = _tone(16000, 0.6, 6)
    path = tmp_path / "six.wav"
    sf.write(path, frames, 16000, subtype="FLOAT")
    wav, sr = load_audio(path)
    assert sr == 16000
    np.testing.assert_array_equal(wav, frames.mean(axis=1, dtype=np.float32))
    wav_str, _ = load_audio(str(path))
    np.testing.assert_array_equal(wav_str, wav)


@pytest.mark.parametrize(
    "data",
    [b"", b"not audio at all" * 64, b"RIFF\x24\x00\x00\x00WAVEfmt ", bytes(range(256)) * 40],
    ids=["empty", "text", "truncated-header", "garbage"],
)
def test_undecodable_input_is_a_prompt_audio_error(data: bytes) -> None:
    with pytest.raises(PromptAudioError) as info:
        load_audio(data)
    assert isinstance(info.value, InvalidRequestError)
    assert info.value.code == "invalid_prompt_audio"
    assert str(info.value) in ("prompt audio is empty", "prompt audio could not be decoded")


def test_truncated_data_decodes_what_is_there() -> None:
    data = _encode_soundfile(_tone(16000, 2.0), 16000, "WAV", "PCM_16")
    wav, _ = load_audio(data[: len(data) // 2])
    # The header promises 2 s; libsndfile returns the samples that are present.
    assert 15000 < wav.shape[0] < 17000


def test_missing_file_is_not_decodable(tmp_path: Path) -> None:
    with pytest.raises(PromptAudioError, match="could not be decoded"):
        load_audio(tmp_path / "absent.wav")


@pytest.mark.parametrize("via", ["soundfile", "pyav"])
def test_decoding_stops_past_the_duration_limit(via: str) -> None:
    frames = _tone(16000, 31.0)
    data = (
        _encode_soundfile(frames, 16000, "WAV", "PCM_16")
        if via == "soundfile"
        else _encode_pyav(frames, 16000, "adts", "aac")
    )
    with pytest.raises(PromptAudioError, match=r"^prompt audio is longer than the maximum of 30 s$"):
        load_prompt_audio(data, LIMITS)
    wav, _ = load_audio(data)
    assert wav.shape[0] >= 31 * 16000


def test_exactly_the_maximum_duration_is_accepted() -> None:
    data = _encode_soundfile(_tone(16000, 30.0), 16000, "WAV", "PCM_16")
    wav, sr = load_prompt_audio(data, LIMITS)
    assert (wav.shape[0], sr) == (480000, 16000)


def test_valid_prompt_passes() -> None:
    wav = _tone(22050, 3.0)[:, 0]
    validate_prompt_audio(wav, 22050, LIMITS)


@pytest.mark.parametrize(
    ("wav", "sample_rate", "message"),
    [
        (np.zeros(0, np.float32), 16000, r"^prompt audio is empty$"),
        (_tone(16000, 0.4)[:, 0], 16000, r"^prompt audio is 0\.40 s long; at least 0\.5 s is required$"),
        (_tone(16000, 30.5)[:, 0], 16000, r"^prompt audio is longer than the maximum of 30 s$"),
        (np.zeros(16000, np.float32), 16000, r"^prompt audio is silent$"),
        (np.full(16000, 1e-4, np.float32), 16000, r"^prompt audio is silent$"),
        (_tone(4000, 1.0)[:, 0], 4000, r"^prompt audio sample rate 4000 Hz is below the minimum of 8000 Hz$"),
    ],
    ids=["empty", "short", "long", "digital-silence", "minus-80-dBFS", "low-rate"],
)
def test_invalid_prompts_are_rejected_with_stable_messages(
    wav: np.ndarray, sample_rate: int, message: str
) -> None:
    with pytest.raises(PromptAudioError, match=message):
        validate_prompt_audio(wav, sample_rate, LIMITS)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_samples_are_rejected(bad: float) -> None:
    frames = _tone(16000, 1.0)
    frames[1234, 0] = bad
    data = _encode_soundfile(frames, 16000, "WAV", "FLOAT")
    with pytest.raises(PromptAudioError, match=r"^prompt audio contains NaN or infinite samples$"):
        load_prompt_audio(data, LIMITS)


def test_quiet_speech_level_is_not_silence() -> None:
    wav = _tone(16000, 1.0)[:, 0] * 10 ** (-45 / 20)  # about -48 dBFS RMS
    validate_prompt_audio(wav.astype(np.float32), 16000, LIMITS)


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError):
        PromptAudioLimits(min_duration_s=2.0, max_duration_s=1.0)
    with pytest.raises(ValueError):
        PromptAudioLimits(min_sample_rate=0)


@pytest.mark.parametrize(
    ("sr_in", "sr_out"), [(44100, 16000), (48000, 24000), (22050, 24000), (16000, 24000)]
)
def test_resample_keeps_a_tone(sr_in: int, sr_out: int) -> None:
    t_in = np.arange(sr_in) / sr_in
    out = resample(np.sin(2 * np.pi * 1000.0 * t_in).astype(np.float32), sr_in, sr_out)
    assert out.dtype == np.float32 and out.shape == (sr_out,)
    t_out = np.arange(sr_out) / sr_out
    expected = np.sin(2 * np.pi * 1000.0 * t_out)
    # Away from the edges (filter transients) soxr HQ is accurate to better than -80 dB.
    inner = slice(sr_out // 10, -sr_out // 10)
    assert np.abs(out[inner] - expected[inner]).max() < 1e-4


def test_resample_same_rate_is_identity() -> None:
    wav = _tone(16000, 0.5)[:, 0]
    assert resample(wav, 16000, 16000) is wav
