"""Prompt feature extractors: shapes, dtypes, alignment and the shared ONNX sessions."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyserve.errors import ModelDirError
from cosyserve.frontend.features import (
    CAMPPLUS_FILE,
    SPEECH_TOKENIZER_FILE,
    OnnxOptions,
    PromptFeatureExtractor,
    align_zero_shot,
    open_onnx_session,
)
from cosyserve.frontend.features_fbank import kaldi_fbank, speaker_fbank
from cosyserve.frontend.features_mel import PromptMel, WhisperLogMel, slaney_mel_filterbank


def _speechlike(sample_rate: int, seconds: float, seed: int = 0) -> np.ndarray:
    """(N,) float32: an amplitude-modulated harmonic tone plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(sample_rate * seconds)) / sample_rate
    voiced = sum(np.sin(2 * np.pi * 150.0 * k * t) / k for k in range(1, 8))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t)
    return (0.1 * envelope * voiced + 0.003 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="module")
def extractor(tiny_model_dir: Path) -> PromptFeatureExtractor:
    return PromptFeatureExtractor.from_model_dir(tiny_model_dir)


@pytest.mark.parametrize("n", [8000, 8159, 8160, 48001])
def test_whisper_log_mel_shape_and_range(n: int) -> None:
    mel = WhisperLogMel()(_speechlike(16000, n / 16000))
    assert mel.dtype == torch.float32 and mel.shape == (1, 128, n // 160)
    # Dynamic range is clipped to 8 log10 units, i.e. 2 after the (x + 4) / 4 scaling.
    assert float(mel.max() - mel.min()) <= 2.0 + 1e-6


@pytest.mark.parametrize("n", [12000, 12479, 12480, 72000])
def test_prompt_mel_shape(n: int) -> None:
    mel = PromptMel()(_speechlike(24000, n / 24000))
    assert mel.dtype == torch.float32 and mel.shape == (1, n // 480, 80)
    assert mel.is_contiguous()
    assert float(mel.min()) >= float(np.log(1e-5)) - 1e-6


def test_prompt_mel_filters_stop_at_8_khz() -> None:
    filters = slaney_mel_filterbank(24000, 1920, 80, 0.0, 8000.0)
    assert filters.shape == (80, 961) and filters.dtype == np.float32
    assert (filters >= 0).all()
    assert not filters[:, 641:].any()  # 12.5 Hz per bin: bin 640 is 8 kHz
    assert filters.any(axis=1).all()  # no empty filter


@pytest.mark.parametrize("n", [400, 559, 560, 16000])
def test_kaldi_fbank_frames(n: int) -> None:
    feat = kaldi_fbank(_speechlike(16000, n / 16000))
    assert feat.dtype == torch.float32 and feat.shape == (1 + (n - 400) // 160, 80)


def test_speaker_fbank_is_mean_normalised() -> None:
    feat = speaker_fbank(_speechlike(16000, 1.0))
    assert feat.abs().mean(dim=0).gt(0).all()
    torch.testing.assert_close(feat.mean(dim=0), torch.zeros(80), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("t_mel", "n_tok", "expected"),
    [(100, 50, 50), (100, 49, 49), (101, 60, 50), (99, 50, 49), (0, 5, 0)],
)
def test_align_zero_shot(t_mel: int, n_tok: int, expected: int) -> None:
    mel = torch.randn(1, t_mel, 80)
    tokens = torch.arange(n_tok, dtype=torch.int32).unsqueeze(0)
    aligned_mel, aligned_tokens = align_zero_shot(mel, tokens)
    assert aligned_tokens.shape == (1, expected) and aligned_mel.shape == (1, 2 * expected, 80)
    torch.testing.assert_close(aligned_mel, mel[:, : 2 * expected])
    torch.testing.assert_close(aligned_tokens, tokens[:, :expected])


@pytest.mark.parametrize("sample_rate", [16000, 22050, 24000, 48000])
def test_prompt_features_shapes(extractor: PromptFeatureExtractor, sample_rate: int) -> None:
    features = extractor(_speechlike(sample_rate, 3.0), sample_rate)
    assert features.speech_token.dtype == torch.int32 and features.speech_token.shape == (1, 75)
    assert features.speech_feat.dtype == torch.float32 and features.speech_feat.shape == (1, 150, 80)
    assert features.embedding.dtype == torch.float32 and features.embedding.shape == (1, 192)
    assert int(features.speech_token.min()) >= 0 and int(features.speech_token.max()) < 6561


def test_unaligned_features_keep_every_frame(extractor: PromptFeatureExtractor) -> None:
    wav = _speechlike(16000, 2.23)  # 223 whisper frames -> 55 tokens; 111 mel frames
    raw = extractor(wav, 16000, align=False)
    aligned = extractor(wav, 16000)
    assert raw.speech_token.shape == (1, 55) and raw.speech_feat.shape == (1, 111, 80)
    assert aligned.speech_token.shape == (1, 55) and aligned.speech_feat.shape == (1, 110, 80)


def test_extraction_is_pure_and_thread_safe(extractor: PromptFeatureExtractor) -> None:
    wavs = [_speechlike(24000, 1.0 + 0.25 * i, seed=i) for i in range(4)]
    serial = [extractor(w, 24000) for w in wavs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        parallel = list(pool.map(lambda w: extractor(w, 24000), wavs * 2))
    for i, features in enumerate(parallel):
        expected = serial[i % len(wavs)]
        assert torch.equal(features.speech_token, expected.speech_token)
        assert torch.equal(features.speech_feat, expected.speech_feat)
        assert torch.equal(features.embedding, expected.embedding)


def test_onnx_options_reach_the_session(tiny_model_dir: Path) -> None:
    session = open_onnx_session(tiny_model_dir / CAMPPLUS_FILE, OnnxOptions(intra_op_threads=2))
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert session.get_session_options().intra_op_num_threads == 2
    with pytest.raises(ValueError):
        OnnxOptions(intra_op_threads=0)


def test_missing_onnx_model_is_a_model_dir_error(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match=SPEECH_TOKENIZER_FILE):
        PromptFeatureExtractor.from_model_dir(tmp_path)


def test_corrupt_onnx_model_is_a_model_dir_error(tmp_path: Path) -> None:
    (tmp_path / CAMPPLUS_FILE).write_bytes(b"\x00not an onnx graph")
    with pytest.raises(ModelDirError, match=f"cannot load ONNX model {CAMPPLUS_FILE}"):
        open_onnx_session(tmp_path / CAMPPLUS_FILE, OnnxOptions())
