"""Log-mel spectrograms of prompt audio, computed as upstream computes them.

* :class:`WhisperLogMel`: the speech tokenizer's input, openai-whisper's
  ``log_mel_spectrogram(audio, n_mels=128)`` (upstream ``_extract_speech_token``).
* :class:`PromptMel`: the flow's prompt features, Matcha's ``mel_spectrogram`` with
  CosyVoice 2's ``feat_extractor`` parameters (upstream ``_extract_speech_feat``).

Both use a Slaney mel filterbank, built by :func:`slaney_mel_filterbank` exactly as
``librosa.filters.mel`` builds it (which is where whisper's ``mel_filters.npz`` and
Matcha's basis come from), so no librosa is needed at run time. The torch operations are
the reference's own, in the same order, so results agree bit for bit on the same build.
"""

import numpy as np
import numpy.typing as npt
import torch

# Slaney's auditory-toolbox mel scale (librosa's default, htk=False): linear below 1 kHz,
# logarithmic above.
_F_SP = 200.0 / 3
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = float(np.log(6.4) / 27.0)


def _hz_to_mel(hz: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    mel = hz / _F_SP
    high = hz >= _MIN_LOG_HZ
    mel[high] = _MIN_LOG_MEL + np.log(hz[high] / _MIN_LOG_HZ) / _LOGSTEP
    return mel


def _mel_to_hz(mel: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    hz = _F_SP * mel
    high = mel >= _MIN_LOG_MEL
    hz[high] = _MIN_LOG_HZ * np.exp(_LOGSTEP * (mel[high] - _MIN_LOG_MEL))
    return hz


def slaney_mel_filterbank(
    sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> npt.NDArray[np.float32]:
    """Triangular mel filters with Slaney area normalisation: ``(n_mels, n_fft // 2 + 1)`` float32.

    Same values as ``librosa.filters.mel(sr=sample_rate, n_fft=n_fft, n_mels=n_mels,
    fmin=fmin, fmax=fmax)``; ``fmax`` defaults to the Nyquist frequency.
    """
    fmax = sample_rate / 2.0 if fmax is None else fmax
    fft_hz = np.fft.rfftfreq(n=n_fft, d=1.0 / sample_rate)
    edges_mel = np.linspace(
        _hz_to_mel(np.array([fmin], dtype=np.float64))[0],
        _hz_to_mel(np.array([fmax], dtype=np.float64))[0],
        n_mels + 2,
    )
    edges_hz = _mel_to_hz(edges_mel)
    widths = np.diff(edges_hz)
    ramps = np.subtract.outer(edges_hz, fft_hz)  # (n_mels + 2, n_freqs)
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    # librosa stores the triangles as float32 first and then scales them in place; the
    # same two roundings keep the filters bit-identical.
    triangles = np.maximum(0.0, np.minimum(lower, upper)).astype(np.float32)
    area_norm = 2.0 / (edges_hz[2 : n_mels + 2] - edges_hz[:n_mels])
    filters: npt.NDArray[np.float32] = (triangles * area_norm[:, None]).astype(np.float32)
    return filters


class WhisperLogMel:
    """openai-whisper's 128-bin log-mel of 16 kHz audio (n_fft 400, hop 160, Hann).

    Centred STFT with reflect padding, power spectrum, last frame dropped, ``log10`` with a
    1e-10 floor, dynamic range limited to 8 (log10 units) below the maximum, then
    ``(x + 4) / 4``.
    """

    sample_rate = 16000
    n_fft = 400
    hop_length = 160
    n_mels = 128

    def __init__(self) -> None:
        self._filters = torch.from_numpy(slaney_mel_filterbank(self.sample_rate, self.n_fft, self.n_mels))
        self._window = torch.hann_window(self.n_fft)

    def __call__(self, wav_16k: npt.NDArray[np.float32]) -> torch.Tensor:
        """``wav_16k``: (N,) float32, N > 200 -> (1, 128, N // 160) float32."""
        audio = torch.from_numpy(np.ascontiguousarray(wav_16k, dtype=np.float32)).unsqueeze(0)  # (1, N)
        stft = torch.stft(audio, self.n_fft, self.hop_length, window=self._window, return_complex=True)
        power = stft[..., :-1].abs() ** 2  # (1, 201, T)
        log_spec = torch.clamp(self._filters @ power, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return (log_spec + 4.0) / 4.0


class PromptMel:
    """Matcha's 80-bin log-mel of 24 kHz audio, as the flow consumes it.

    n_fft = win = 1920, hop 480, Hann, fmin 0, fmax 8000 (CosyVoice 2) or the Nyquist
    frequency (``fmax=None``: CosyVoice 3's ``feat_extractor``); the signal is reflect-padded by
    (n_fft - hop) / 2 = 720 samples on both sides and framed without centring; magnitude
    ``sqrt(re² + im² + 1e-9)``; natural log with a 1e-5 floor.
    """

    sample_rate = 24000
    n_fft = 1920
    hop_length = 480
    win_length = 1920
    n_mels = 80
    fmin = 0.0

    def __init__(self, fmax: float | None = 8000.0) -> None:
        self.fmax = fmax
        basis = slaney_mel_filterbank(self.sample_rate, self.n_fft, self.n_mels, self.fmin, self.fmax)
        self._basis = torch.from_numpy(basis)
        self._window = torch.hann_window(self.win_length)

    def __call__(self, wav_24k: npt.NDArray[np.float32]) -> torch.Tensor:
        """``wav_24k``: (N,) float32, N > 720 -> (1, N // 480, 80) float32."""
        audio = torch.from_numpy(np.ascontiguousarray(wav_24k, dtype=np.float32)).unsqueeze(0)  # (1, N)
        pad = (self.n_fft - self.hop_length) // 2
        audio = torch.nn.functional.pad(audio.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
        stft = torch.stft(
            audio,
            self.n_fft,
            hop_length=self.hop_length,
            win_length=self.win_length,
            window=self._window,
            center=False,
            normalized=False,
            onesided=True,
            return_complex=True,
        )
        magnitude = torch.sqrt(torch.view_as_real(stft).pow(2).sum(-1) + 1e-9)  # (1, 961, T)
        mel = torch.log(torch.clamp(torch.matmul(self._basis, magnitude), min=1e-5))  # (1, 80, T)
        return mel.transpose(1, 2).contiguous()
