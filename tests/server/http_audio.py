"""Prompt recordings and PCM helpers for the HTTP and WebSocket tests."""

import io
import wave

import numpy as np

BUILTIN = "中文女"  # a spk2info.pt speaker of the generated tiny model
SAMPLE_RATE = 24000
PROMPT_TEXT = "hello there, how are you?"


def prompt_wav(seconds: float = 1.0, rate: int = 16000, seed: int = 0) -> bytes:
    """16-bit mono WAV: a gliding harmonic tone in syllable-like bursts plus a little noise."""
    gen = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(120 + 40 * np.sin(2 * np.pi * 1.5 * t)) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    signal = 0.15 * (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)) * voiced + 0.01 * gen.standard_normal(t.size)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.round(np.clip(signal, -1, 1) * 32767).astype("<i2").tobytes())
    return out.getvalue()


def pcm_samples(data: bytes) -> np.ndarray:
    """Little-endian int16 PCM bytes as (N,) int16; fails on a torn sample."""
    assert len(data) % 2 == 0, f"{len(data)} bytes is not whole int16 samples"
    return np.frombuffer(data, dtype="<i2")


def assert_same_pcm(a: bytes, b: bytes) -> None:
    """The same audio to float rounding: equal lengths, every sample within 3 LSB (1e-4
    of full scale, what the engine promises a request that overlaps others: the chunks
    of requests in the engine at once share batched flow and vocoder calls, whose
    rounding can move a sample by one LSB). A wrong seed, voice or token moves thousands
    of samples by far more."""
    x, y = pcm_samples(a).astype(np.int32), pcm_samples(b).astype(np.int32)
    assert x.size == y.size, f"{x.size} vs {y.size} samples"
    worst = int(np.abs(x - y).max(initial=0))
    assert worst <= 3, f"samples differ by up to {worst} LSB"


def assert_speechlike_pcm(data: bytes, min_seconds: float = 0.1) -> np.ndarray:
    """Audio, not silence or noise-free junk: long enough, not constant."""
    samples = pcm_samples(data)
    assert samples.size >= min_seconds * SAMPLE_RATE, f"only {samples.size} samples"
    assert np.abs(samples).max() > 0 and np.std(samples.astype(np.float64)) > 1.0
    return samples
