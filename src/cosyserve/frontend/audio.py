"""Prompt audio: decoding, validation and resampling.

Upstream reads prompt files with ``torchaudio.load(backend='soundfile')`` (float32 in
[-1, 1]), averages the channels and resamples to 16 kHz (speech tokenizer, speaker
encoder) and 24 kHz (prompt mel). We decode with soundfile as well, so WAV/FLAC/OGG
(and MP3, which libsndfile >= 1.1 reads) give the same samples; whatever libsndfile cannot
open (MP4/AAC, WebM/Opus, raw MP3 streams it does not sniff, ...) goes through PyAV.
Resampling uses soxr (upstream: torchaudio's sinc resampler), so resampled audio agrees
with upstream only to within resampler differences.
"""

import io
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import av
import numpy as np
import numpy.typing as npt
import soundfile as sf
import soxr

from cosyserve.errors import PromptAudioError

logger = logging.getLogger(__name__)

AudioSource = bytes | str | os.PathLike[str]
Waveform = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class PromptAudioLimits:
    """What prompt audio is accepted.

    ``max_duration_s`` is upstream's limit (its speech tokenizer asserts <= 30 s).
    ``silence_rms_dbfs``: audio whose RMS over the whole clip is below this level (dB
    relative to full scale 1.0) is rejected as silent. -70 dBFS lies well under quiet speech
    (about -40 to -30 dBFS) and above 16-bit dither noise (about -100 dBFS), so it rejects
    digital silence and near-silent recordings but no real voice.
    """

    min_duration_s: float = 0.5
    max_duration_s: float = 30.0
    silence_rms_dbfs: float = -70.0
    min_sample_rate: int = 8000

    def __post_init__(self) -> None:
        if not 0 < self.min_duration_s <= self.max_duration_s:
            raise ValueError("need 0 < min_duration_s <= max_duration_s")
        if self.min_sample_rate <= 0:
            raise ValueError("min_sample_rate must be positive")


def load_audio(source: AudioSource, *, max_duration_s: float | None = None) -> tuple[Waveform, int]:
    """Decode an audio file (bytes or path) to mono float32.

    Returns ``(wav, sample_rate)`` with ``wav`` of shape ``(N,)`` float32, the mean of the
    channels, at the file's own sample rate. With ``max_duration_s``, decoding stops once
    the audio is known to be longer, and :class:`PromptAudioError` is raised, so that a
    long upload costs no more than the limit to reject.

    Raises :class:`PromptAudioError` when nothing decodes the input.
    """
    if isinstance(source, bytes) and not source:
        raise PromptAudioError("prompt audio is empty")
    try:
        decoded = _decode_soundfile(source, max_duration_s)
    except sf.SoundFileError as exc:
        logger.debug("soundfile could not decode the audio (%s); trying PyAV", exc)
        decoded = None
    if decoded is None:
        try:
            decoded = _decode_pyav(source, max_duration_s)
        except (av.FFmpegError, OSError, ValueError, IndexError) as exc:
            logger.debug("PyAV could not decode the audio: %s", exc)
            raise PromptAudioError("prompt audio could not be decoded") from exc
    channels, sample_rate = decoded
    if sample_rate <= 0:
        raise PromptAudioError("prompt audio could not be decoded")
    if max_duration_s is not None and channels.shape[0] > _max_frames(max_duration_s, sample_rate):
        raise PromptAudioError(f"prompt audio is longer than the maximum of {max_duration_s:g} s")
    # Upstream: speech.mean(dim=0) over channels, in float32.
    wav = channels.mean(axis=1, dtype=np.float32) if channels.shape[1] > 1 else channels[:, 0]
    return np.ascontiguousarray(wav, dtype=np.float32), sample_rate


def validate_prompt_audio(wav: Waveform, sample_rate: int, limits: PromptAudioLimits) -> None:
    """Raise :class:`PromptAudioError` unless ``wav`` ((N,) float32) is usable prompt audio."""
    if wav.size == 0:
        raise PromptAudioError("prompt audio is empty")
    if sample_rate < limits.min_sample_rate:
        raise PromptAudioError(
            f"prompt audio sample rate {sample_rate} Hz is below the minimum of {limits.min_sample_rate} Hz"
        )
    if not np.isfinite(wav).all():
        raise PromptAudioError("prompt audio contains NaN or infinite samples")
    duration_s = wav.shape[0] / sample_rate
    if duration_s < limits.min_duration_s:
        raise PromptAudioError(
            f"prompt audio is {duration_s:.2f} s long; at least {limits.min_duration_s:g} s is required"
        )
    if wav.shape[0] > _max_frames(limits.max_duration_s, sample_rate):
        raise PromptAudioError(f"prompt audio is longer than the maximum of {limits.max_duration_s:g} s")
    rms = math.sqrt(float(np.mean(np.square(wav, dtype=np.float64))))
    if rms < 10.0 ** (limits.silence_rms_dbfs / 20.0):
        raise PromptAudioError("prompt audio is silent")


def load_prompt_audio(source: AudioSource, limits: PromptAudioLimits) -> tuple[Waveform, int]:
    """:func:`load_audio` then :func:`validate_prompt_audio`: ``(wav (N,) float32, sample_rate)``."""
    wav, sample_rate = load_audio(source, max_duration_s=limits.max_duration_s)
    validate_prompt_audio(wav, sample_rate, limits)
    return wav, sample_rate


def resample(wav: Waveform, sr_in: int, sr_out: int) -> Waveform:
    """Resample ``wav`` ((N,) float32) from ``sr_in`` to ``sr_out`` Hz with soxr's HQ filter.

    Returns ``(round(N * sr_out / sr_in),)`` float32 (the input itself when the rates match).
    """
    if sr_in == sr_out:
        return wav
    out: Waveform = soxr.resample(np.ascontiguousarray(wav, dtype=np.float32), sr_in, sr_out, quality="HQ")
    return out


def _max_frames(max_duration_s: float, sample_rate: int) -> int:
    return math.floor(max_duration_s * sample_rate + 1e-6)


def _limit_frames(max_duration_s: float | None, sample_rate: int) -> int:
    """Frames to decode at most: one past the limit, enough to tell that it is exceeded."""
    return -1 if max_duration_s is None else _max_frames(max_duration_s, sample_rate) + 1


def _as_file(source: AudioSource) -> Any:
    return io.BytesIO(source) if isinstance(source, bytes) else source


def _decode_soundfile(source: AudioSource, max_duration_s: float | None) -> tuple[Waveform, int]:
    """(frames, channels) float32 and the sample rate, via libsndfile."""
    with sf.SoundFile(_as_file(source)) as f:
        sample_rate = int(f.samplerate)
        data = f.read(frames=_limit_frames(max_duration_s, sample_rate), dtype="float32", always_2d=True)
    return data, sample_rate


def _decode_pyav(source: AudioSource, max_duration_s: float | None) -> tuple[Waveform, int]:
    """(frames, channels) float32 and the sample rate of the first audio stream, via FFmpeg."""
    with av.open(_as_file(source), mode="r") as container:
        stream = container.streams.audio[0]
        if stream.codec_context is None:
            # FFmpeg found an audio stream but has no decoder for its codec (e.g. an unknown
            # WAV format tag); the stream then has no rate or layout at all.
            raise ValueError("no decoder for the audio codec")
        sample_rate = int(stream.rate or 0)
        limit = None if max_duration_s is None else _max_frames(max_duration_s, sample_rate)
        # Output format, layout and rate are fixed to the stream's, so that a mid-stream
        # change of any of them is converted rather than concatenated raw.
        resampler = av.AudioResampler(format="fltp", layout=stream.layout, rate=sample_rate)
        blocks: list[Waveform] = []
        decoded = 0
        for frame in container.decode(stream):
            for converted in resampler.resample(frame):
                blocks.append(_planar_to_frames(converted))
                decoded += blocks[-1].shape[0]
            if limit is not None and decoded > limit:
                break
        else:
            blocks.extend(_planar_to_frames(converted) for converted in resampler.resample(None))
    channels = stream.layout.nb_channels
    if not blocks:
        return np.zeros((0, channels), dtype=np.float32), sample_rate
    return np.concatenate(blocks, axis=0), sample_rate


def _planar_to_frames(frame: av.AudioFrame) -> Waveform:
    """A planar float frame as (samples, channels) float32."""
    return np.asarray(frame.to_ndarray(), dtype=np.float32).T
