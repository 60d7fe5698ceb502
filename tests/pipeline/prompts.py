"""Synthetic prompt recordings for pipeline tests (WAV bytes, seeded)."""

import io
import wave

import numpy as np

PROMPT_TEXT = "hello there, how are you?"
# 0.8 s at 25 tokens per second: 20 prompt tokens, so the first streaming hop is padded
# by 5 to reach the 25-token block boundary.
PROMPT_SECONDS = 0.8
PROMPT_TOKENS = 20


def speechlike(seconds: float, rate: int = 16000, seed: int = 0, amplitude: float = 0.3) -> np.ndarray:
    """(N,) float32: a gliding harmonic tone in syllable-like bursts, plus a little noise."""
    gen = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate)) / rate
    f0 = 120 + 40 * np.sin(2 * np.pi * 1.5 * t + gen.uniform(0, np.pi))
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)
    signal = amplitude * envelope * voiced / 2 + 0.01 * gen.standard_normal(t.size)
    return signal.astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = 16000) -> bytes:
    """16-bit mono WAV of ``samples`` (float in [-1, 1])."""
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return out.getvalue()


def prompt_wav(seconds: float = PROMPT_SECONDS, seed: int = 0) -> bytes:
    return wav_bytes(speechlike(seconds, seed=seed))
