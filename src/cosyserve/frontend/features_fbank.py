"""The speaker encoder's input: 80-bin Kaldi log-fbank with per-utterance mean removal.

Upstream calls ``torchaudio.compliance.kaldi.fbank(speech, num_mel_bins=80, dither=0,
sample_frequency=16000)`` and subtracts the mean over time. kaldi-native-fbank computes
the same Kaldi recipe (25 ms Povey windows every 10 ms, snip_edges, DC removal,
pre-emphasis 0.97, 512-point power spectrum, Kaldi mel banks from 20 Hz to Nyquist,
log with a float32-epsilon floor). Like upstream, the waveform is fed in its [-1, 1]
float scale, not rescaled to Kaldi's int16 range: the scale shifts every log-energy by the
same constant, which the mean removal cancels except where the epsilon floor is hit, and
matching upstream there keeps CAM++'s input identical.
"""

import kaldi_native_fbank as knf
import numpy as np
import numpy.typing as npt
import torch

SAMPLE_RATE = 16000
NUM_MEL_BINS = 80


def _fbank_options() -> knf.FbankOptions:
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = SAMPLE_RATE
    opts.frame_opts.dither = 0.0
    opts.frame_opts.snip_edges = True
    opts.mel_opts.num_bins = NUM_MEL_BINS
    # The remaining defaults equal torchaudio's: frame 25 ms / shift 10 ms, povey window,
    # preemph 0.97, remove_dc_offset, round_to_power_of_two, low_freq 20, high_freq 0
    # (Nyquist), use_energy False, use_power True, use_log_fbank True.
    return opts


def kaldi_fbank(wav_16k: npt.NDArray[np.float32]) -> torch.Tensor:
    """``wav_16k``: (N,) float32 in [-1, 1], N >= 400 -> (1 + (N - 400) // 160, 80) float32 log-fbank."""
    fbank = knf.OnlineFbank(_fbank_options())
    fbank.accept_waveform(SAMPLE_RATE, np.ascontiguousarray(wav_16k, dtype=np.float32))
    fbank.input_finished()
    # get_frame returns a view of the extractor's buffer; np.stack copies it out.
    frames = np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])
    return torch.from_numpy(frames)


def speaker_fbank(wav_16k: npt.NDArray[np.float32]) -> torch.Tensor:
    """CAM++ input features: :func:`kaldi_fbank` minus its mean over time, (T, 80) float32."""
    feat = kaldi_fbank(wav_16k)
    return feat - feat.mean(dim=0, keepdim=True)
