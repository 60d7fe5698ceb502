"""CAM++ speaker encoder (``campplus.onnx``): 16 kHz audio -> 192-dim x-vector."""

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
import torch

from cosyserve.frontend.features_fbank import speaker_fbank


class SpeakerEncoder:
    """Runs the CAM++ ONNX graph on mean-normalised Kaldi fbank features.

    The session is shared (ORT's ``run`` is thread-safe); calls keep no state. Input 0
    (by position, as upstream) is the ``(1, T, 80)`` float32 fbank; output 0 the embedding.
    """

    def __init__(self, session: ort.InferenceSession) -> None:
        self._session = session

    def __call__(self, wav_16k: npt.NDArray[np.float32]) -> torch.Tensor:
        """``wav_16k``: (N,) float32 in [-1, 1], N >= 400 -> (1, 192) float32 embedding."""
        return self.embed_fbank(speaker_fbank(wav_16k))

    def embed_fbank(self, fbank: torch.Tensor) -> torch.Tensor:
        """``fbank``: (T, 80) float32, mean-normalised -> (1, D) float32 (D = 192 for CAM++)."""
        feed = {self._session.get_inputs()[0].name: fbank.unsqueeze(0).numpy()}
        embedding = np.asarray(self._session.run(None, feed)[0], dtype=np.float32).reshape(1, -1)
        return torch.from_numpy(embedding)
