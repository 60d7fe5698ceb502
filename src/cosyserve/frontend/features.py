"""Prompt features for zero-shot synthesis: speech tokens, prompt mel and speaker embedding.

The two ONNX sessions (speech tokenizer, CAM++) are the shared part of the frontend: open
them once per model directory with :meth:`PromptFeatureExtractor.from_model_dir` and reuse
the extractor across requests; a call keeps no state.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort
import torch

from cosyserve.errors import ModelDirError
from cosyserve.frontend.audio import Waveform, resample
from cosyserve.frontend.features_mel import PromptMel
from cosyserve.frontend.speaker_encoder import SpeakerEncoder
from cosyserve.frontend.speech_tokenizer import SpeechTokenizer

logger = logging.getLogger(__name__)

SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
CAMPPLUS_FILE = "campplus.onnx"
# The speech tokenizer and CAM++ both take 16 kHz audio.
SAMPLE_RATE_16K = 16000


@dataclass(frozen=True, slots=True)
class OnnxOptions:
    """ONNX Runtime CPU threading. Upstream uses one intra-op thread per session."""

    intra_op_threads: int = 1
    inter_op_threads: int = 1

    def __post_init__(self) -> None:
        if self.intra_op_threads < 1 or self.inter_op_threads < 1:
            raise ValueError("ONNX thread counts must be at least 1")


def open_onnx_session(path: Path, options: OnnxOptions) -> ort.InferenceSession:
    """An ORT session on the CPU provider with all graph optimisations (as upstream)."""
    if not path.is_file():
        raise ModelDirError(f"missing ONNX model {path.name} in the model directory")
    session_options = ort.SessionOptions()
    session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session_options.intra_op_num_threads = options.intra_op_threads
    session_options.inter_op_num_threads = options.inter_op_threads
    try:
        return ort.InferenceSession(
            str(path), sess_options=session_options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:  # ORT raises its own untyped Fail/InvalidGraph exceptions
        raise ModelDirError(f"cannot load ONNX model {path.name}: {exc}") from exc


@dataclass(frozen=True, slots=True, eq=False)
class PromptFeatures:
    """What the LM and the flow take from a prompt recording (upstream ``frontend_zero_shot``).

    speech_token: (1, L) int32, 25 Hz; speech_feat: (1, T_mel, 80) float32, 50 Hz
    (T_mel = 2 L once aligned); embedding: (1, 192) float32 CAM++ x-vector.
    """

    speech_token: torch.Tensor
    speech_feat: torch.Tensor
    embedding: torch.Tensor


def align_zero_shot(
    speech_feat: torch.Tensor, speech_token: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trim mel and tokens to exactly two mel frames per token, as upstream CosyVoice 2 does.

    ``speech_feat``: (1, T_mel, 80); ``speech_token``: (1, L). Returns
    ``(speech_feat[:, :2 n], speech_token[:, :n])`` with ``n = min(T_mel // 2, L)``.
    """
    token_len = min(speech_feat.shape[1] // 2, speech_token.shape[1])
    return speech_feat[:, : 2 * token_len], speech_token[:, :token_len]


class PromptFeatureExtractor:
    """Prompt audio -> :class:`PromptFeatures`, with shared, reusable ONNX sessions."""

    def __init__(
        self,
        speech_tokenizer: SpeechTokenizer,
        speaker_encoder: SpeakerEncoder,
        mel_fmax: float | None = 8000.0,
    ) -> None:
        self.speech_tokenizer = speech_tokenizer
        self.speaker_encoder = speaker_encoder
        self.prompt_mel = PromptMel(mel_fmax)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: Path,
        options: OnnxOptions | None = None,
        *,
        speech_tokenizer_file: str = SPEECH_TOKENIZER_FILE,
        mel_fmax: float | None = 8000.0,
    ) -> "PromptFeatureExtractor":
        """Open the speech tokenizer (``speech_tokenizer_v2.onnx`` unless another file is
        named: CosyVoice 3's is ``speech_tokenizer_v3.onnx``) and ``campplus.onnx`` from
        ``model_dir``; prompt mels up to ``mel_fmax`` Hz (None: Nyquist)."""
        options = options or OnnxOptions()
        tokenizer = SpeechTokenizer(open_onnx_session(model_dir / speech_tokenizer_file, options))
        encoder = SpeakerEncoder(open_onnx_session(model_dir / CAMPPLUS_FILE, options))
        logger.info("prompt feature extractor ready (%s)", model_dir)
        return cls(tokenizer, encoder, mel_fmax)

    def __call__(self, wav: Waveform, sample_rate: int, *, align: bool = True) -> PromptFeatures:
        """``wav``: (N,) float32 validated prompt audio at ``sample_rate`` Hz.

        ``align=False`` keeps the untrimmed features (upstream's voice-conversion frontend).
        """
        wav_16k = resample(wav, sample_rate, SAMPLE_RATE_16K)
        speech_feat = self.prompt_mel(resample(wav, sample_rate, PromptMel.sample_rate))
        speech_token = self.speech_tokenizer(wav_16k)
        if align:
            speech_feat, speech_token = align_zero_shot(speech_feat, speech_token)
        embedding = self.speaker_encoder(wav_16k)
        return PromptFeatures(speech_token=speech_token, speech_feat=speech_feat, embedding=embedding)
