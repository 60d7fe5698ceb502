"""S3 speech tokenizer v2 (``speech_tokenizer_v2.onnx``): 16 kHz audio -> 25 Hz speech tokens."""

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
import torch

from cosyserve.frontend.features_mel import WhisperLogMel


class SpeechTokenizer:
    """Runs the speech tokenizer ONNX graph on Whisper log-mel features.

    The session is shared (ORT's ``run`` is thread-safe); calls keep no state. Like
    upstream, inputs and outputs are taken by position, not by name: input 0 is the
    ``(1, 128, T)`` float32 log-mel, input 1 the ``(1,)`` int32 frame count, output 0 the
    token ids.
    """

    def __init__(self, session: ort.InferenceSession) -> None:
        self._session = session
        self._log_mel = WhisperLogMel()

    def __call__(self, wav_16k: npt.NDArray[np.float32]) -> torch.Tensor:
        """``wav_16k``: (N,) float32, at most 30 s -> (1, L) int32 tokens, L about N / 640."""
        return self.tokenize_mel(self._log_mel(wav_16k))

    def tokenize_mel(self, mel: torch.Tensor) -> torch.Tensor:
        """``mel``: (1, 128, T) float32 Whisper log-mel -> (1, L) int32 tokens."""
        inputs = self._session.get_inputs()
        feed = {
            inputs[0].name: mel.numpy(),
            inputs[1].name: np.array([mel.shape[2]], dtype=np.int32),
        }
        tokens = np.asarray(self._session.run(None, feed)[0]).reshape(1, -1)
        return torch.from_numpy(tokens.astype(np.int32))
