"""Parity of the prompt features with the functions upstream calls, on the same audio.

References (test-only, never imported by cosyserve):
* prompt mel: ``matcha.utils.audio.mel_spectrogram`` from cosyvoice-minicpmo, configured
  by the model directory's ``feat_extractor`` yaml entry as upstream configures it;
* speech tokenizer input: openai-whisper's ``log_mel_spectrogram`` (its ``whisper/audio.py``
  and ``mel_filters.npz``; 20250625 is identical to upstream's 20231117 pin there);
* speaker encoder input: torchaudio's pure-PyTorch ``compliance.kaldi.fbank``;
* the whole zero-shot frontend: upstream ``CosyVoiceFrontEnd``'s own methods driving the
  same ONNX sessions.
openai-whisper's package ``__init__`` needs tiktoken and the only torchaudio wheel is a
CUDA build that does not import here, so scripts/install puts both, without dependencies,
in ``.venv/reference`` (outside site-packages), and the modules are loaded from there by
file path.
"""

import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import librosa
import numpy as np
import pytest
import torch

from cosyserve.frontend.audio import resample
from cosyserve.frontend.features import (
    CAMPPLUS_FILE,
    SPEECH_TOKENIZER_FILE,
    OnnxOptions,
    PromptFeatureExtractor,
    open_onnx_session,
)
from cosyserve.frontend.features_fbank import kaldi_fbank, speaker_fbank
from cosyserve.frontend.features_mel import PromptMel, WhisperLogMel, slaney_mel_filterbank
from cosyserve.frontend.speaker_encoder import SpeakerEncoder
from cosyserve.frontend.speech_tokenizer import SpeechTokenizer
from cosyserve.modeldir.presets import TINY3
from cosyserve.modeldir.yamlwrite3 import render_yaml3
from tests.upstream import load_yaml_sections, upstream

pytestmark = pytest.mark.parity

REFERENCE_DIR = Path(sys.prefix) / "reference"
# kaldi-native-fbank and torchaudio run the same float32 recipe with different FFTs and
# summation orders; log-energies differ by up to 4.5e-4 (measured on 0.5-30 s clips).
FBANK_ATOL = 1e-3


def _load_by_path(name: str, path: Path, package_dir: Path | None = None) -> types.ModuleType:
    if not path.is_file():
        pytest.fail(f"test reference {path} is missing: run scripts/install")
    if package_dir is not None:
        # A private parent package, so that the module's relative imports resolve without
        # running the real package __init__.
        parent = types.ModuleType(name.rpartition(".")[0])
        parent.__path__ = [str(package_dir)]
        sys.modules[parent.__name__] = parent
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def whisper_audio() -> types.ModuleType:
    whisper_dir = REFERENCE_DIR / "whisper"
    return _load_by_path("_whisper_reference.audio", whisper_dir / "audio.py", whisper_dir)


@pytest.fixture(scope="module")
def torchaudio_kaldi() -> types.ModuleType:
    upstream("matcha")  # registers the torchaudio stand-in that kaldi.py's bare `import torchaudio` gets
    return _load_by_path("_torchaudio_kaldi_reference", REFERENCE_DIR / "torchaudio/compliance/kaldi.py")


@pytest.fixture(scope="module")
def matcha_feat_extractor(tiny_model_dir: Path) -> Any:
    matcha = upstream("matcha")
    upstream("matcha.utils.audio")
    yaml_text = (tiny_model_dir / "cosyvoice2.yaml").read_text(encoding="utf-8")
    with pytest.MonkeyPatch.context() as patch:
        # hyperpyyaml resolves `!name:` by attribute walk from `matcha`; the matcha.utils
        # stand-in is only in sys.modules, so attach it for the walk.
        patch.setattr(matcha, "utils", sys.modules["matcha.utils"], raising=False)
        return load_yaml_sections(yaml_text, ("feat_extractor",))["feat_extractor"]


class _SoxrResample:
    """Stand-in for ``torchaudio.transforms.Resample`` that resamples as cosyserve does, so
    that the end-to-end comparison isolates the features from the resampler."""

    def __init__(self, orig_freq: int, new_freq: int) -> None:
        self.rates = (orig_freq, new_freq)

    def __call__(self, speech: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(resample(speech[0].numpy(), *self.rates)).unsqueeze(0)


@pytest.fixture(scope="module")
def upstream_frontend_class(
    whisper_audio: types.ModuleType, torchaudio_kaldi: types.ModuleType
) -> Iterator[type]:
    """Upstream ``CosyVoiceFrontEnd``, its ``whisper`` and ``torchaudio.compliance.kaldi``
    imports bound to the references (sys.modules is restored afterwards)."""
    origin = importlib.util.find_spec("cosyvoice.cli.frontend")
    assert origin is not None and origin.origin is not None
    torchaudio_stand_in = sys.modules["torchaudio"]
    with pytest.MonkeyPatch.context() as patch:
        compliance = types.ModuleType("torchaudio.compliance")
        compliance.kaldi = torchaudio_kaldi  # type: ignore[attr-defined]
        # frontend.py imports inflect only for text normalisation (4 s of import time).
        patch.setitem(sys.modules, "inflect", types.ModuleType("inflect"))
        patch.setitem(sys.modules, "whisper", whisper_audio)
        patch.setitem(sys.modules, "torchaudio.compliance", compliance)
        patch.setitem(sys.modules, "torchaudio.compliance.kaldi", torchaudio_kaldi)
        patch.setattr(torchaudio_stand_in, "compliance", compliance, raising=False)
        patch.setattr(
            torchaudio_stand_in, "transforms", types.SimpleNamespace(Resample=_SoxrResample), raising=False
        )
        module = _load_by_path("_upstream_cosyvoice_frontend", Path(origin.origin))
        yield module.CosyVoiceFrontEnd


def _speechlike(sample_rate: int, seconds: float, seed: int) -> np.ndarray:
    """(N,) float32: harmonics with vibrato, a syllable envelope, noise and a silent gap
    (digital zeros, which exercise the log floors)."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(sample_rate * seconds)) / sample_rate
    f0 = 120.0 + 40.0 * seed + 15.0 * np.sin(2 * np.pi * 5.0 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = np.clip(np.sin(2 * np.pi * 2.5 * t), 0.0, None) ** 0.5
    wav = 0.15 * envelope * voiced + 0.002 * rng.standard_normal(t.size)
    gap = slice(round(0.3 * sample_rate), round(0.45 * sample_rate))
    wav[gap] = 0.0
    return np.clip(wav, -0.99, 0.99).astype(np.float32)


SIGNALS = [(0.5, 0), (1.37, 1), (3.0, 2), (7.91, 3)]


def test_mel_filterbanks_equal_librosa_and_whisper_assets() -> None:
    whisper_filters = np.load(REFERENCE_DIR / "whisper/assets/mel_filters.npz")["mel_128"]
    ours = slaney_mel_filterbank(16000, 400, 128)
    np.testing.assert_array_equal(ours, whisper_filters)
    np.testing.assert_array_equal(ours, librosa.filters.mel(sr=16000, n_fft=400, n_mels=128))
    np.testing.assert_array_equal(
        slaney_mel_filterbank(24000, 1920, 80, 0.0, 8000.0),
        librosa.filters.mel(sr=24000, n_fft=1920, n_mels=80, fmin=0, fmax=8000),
    )


@pytest.mark.parametrize(("seconds", "seed"), SIGNALS)
def test_prompt_mel_matches_matcha(matcha_feat_extractor: Any, seconds: float, seed: int) -> None:
    wav = _speechlike(24000, seconds, seed)
    expected = matcha_feat_extractor(torch.from_numpy(wav).unsqueeze(0)).transpose(1, 2)
    # The same torch ops in the same order: bit-identical (measured max abs diff 0).
    torch.testing.assert_close(PromptMel()(wav), expected, atol=0.0, rtol=0.0)


def test_cosyvoice3_prompt_mel_matches_its_feat_extractor() -> None:
    """CosyVoice 3's yaml asks for the mel up to the Nyquist frequency (fmax null)."""
    matcha = upstream("matcha")
    upstream("matcha.utils.audio")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(matcha, "utils", sys.modules["matcha.utils"], raising=False)
        extractor = load_yaml_sections(render_yaml3(TINY3), ("feat_extractor",))["feat_extractor"]
    wav = _speechlike(24000, 1.37, 1)
    expected = extractor(torch.from_numpy(wav).unsqueeze(0)).transpose(1, 2)
    torch.testing.assert_close(PromptMel(fmax=None)(wav), expected, atol=0.0, rtol=0.0)
    assert not torch.equal(PromptMel()(wav), expected)  # the CosyVoice 2 mel is another


@pytest.mark.parametrize(("seconds", "seed"), SIGNALS)
def test_whisper_log_mel_matches_openai_whisper(
    whisper_audio: types.ModuleType, seconds: float, seed: int
) -> None:
    wav = _speechlike(16000, seconds, seed)
    expected = whisper_audio.log_mel_spectrogram(torch.from_numpy(wav).unsqueeze(0), n_mels=128)
    # Same ops, same filters: bit-identical (measured max abs diff 0).
    torch.testing.assert_close(WhisperLogMel()(wav), expected, atol=0.0, rtol=0.0)


@pytest.mark.parametrize(("seconds", "seed"), SIGNALS)
def test_kaldi_fbank_matches_torchaudio(
    torchaudio_kaldi: types.ModuleType, seconds: float, seed: int
) -> None:
    wav = _speechlike(16000, seconds, seed)
    expected = torchaudio_kaldi.fbank(
        torch.from_numpy(wav).unsqueeze(0), num_mel_bins=80, dither=0, sample_frequency=16000
    )
    ours = kaldi_fbank(wav)
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=FBANK_ATOL, rtol=0.0)
    torch.testing.assert_close(
        speaker_fbank(wav), expected - expected.mean(dim=0, keepdim=True), atol=FBANK_ATOL, rtol=0.0
    )


@pytest.fixture(scope="module")
def sessions(tiny_model_dir: Path) -> tuple[Any, Any]:
    options = OnnxOptions()
    return (
        open_onnx_session(tiny_model_dir / SPEECH_TOKENIZER_FILE, options),
        open_onnx_session(tiny_model_dir / CAMPPLUS_FILE, options),
    )


@pytest.fixture(scope="module")
def upstream_frontend(
    upstream_frontend_class: type, sessions: tuple[Any, Any], matcha_feat_extractor: Any
) -> Any:
    """An upstream frontend instance around our sessions, without its constructor (which
    would load a real tokenizer and the ONNX files itself)."""
    frontend: Any = object.__new__(upstream_frontend_class)
    frontend.speech_tokenizer_session, frontend.campplus_session = sessions
    frontend.feat_extractor = matcha_feat_extractor
    frontend.device = torch.device("cpu")
    frontend.tokenizer = types.SimpleNamespace(encode=lambda text, allowed_special=None: [1, 2, 3])
    frontend.allowed_special = "all"
    frontend.spk2info = {}
    return frontend


@pytest.mark.parametrize(("seconds", "seed"), SIGNALS)
def test_onnx_inputs_are_driven_as_upstream(
    upstream_frontend: Any,
    sessions: tuple[Any, Any],
    whisper_audio: types.ModuleType,
    torchaudio_kaldi: types.ModuleType,
    seconds: float,
    seed: int,
) -> None:
    """Upstream's own features through our ONNX wrappers give upstream's outputs exactly."""
    speech = torch.from_numpy(_speechlike(16000, seconds, seed)).unsqueeze(0)
    tokenizer_session, campplus_session = sessions
    tokens, token_len = upstream_frontend._extract_speech_token(speech)
    mel = whisper_audio.log_mel_spectrogram(speech, n_mels=128)
    assert torch.equal(SpeechTokenizer(tokenizer_session).tokenize_mel(mel), tokens)
    assert tokens.dtype == torch.int32 and int(token_len[0]) == tokens.shape[1]

    embedding = upstream_frontend._extract_spk_embedding(speech)
    fbank = torchaudio_kaldi.fbank(speech, num_mel_bins=80, dither=0, sample_frequency=16000)
    ours = SpeakerEncoder(campplus_session).embed_fbank(fbank - fbank.mean(dim=0, keepdim=True))
    assert ours.dtype == embedding.dtype == torch.float32
    assert torch.equal(ours, embedding)


@pytest.mark.parametrize(("seconds", "seed"), SIGNALS)
def test_zero_shot_features_match_upstream_frontend(
    upstream_frontend: Any, sessions: tuple[Any, Any], seconds: float, seed: int
) -> None:
    """Upstream ``frontend_zero_shot`` (features, 2:1 alignment) against our extractor on the
    same 16 kHz prompt; both resample to 24 kHz with soxr (see :class:`_SoxrResample`)."""
    wav = _speechlike(16000, seconds, seed)
    model_input = upstream_frontend.frontend_zero_shot(
        "text", "prompt", torch.from_numpy(wav).unsqueeze(0), 24000, ""
    )
    extractor = PromptFeatureExtractor(SpeechTokenizer(sessions[0]), SpeakerEncoder(sessions[1]))
    ours = extractor(wav, 16000)

    assert torch.equal(ours.speech_token, model_input["flow_prompt_speech_token"])
    assert int(model_input["flow_prompt_speech_token_len"][0]) == ours.speech_token.shape[1]
    torch.testing.assert_close(ours.speech_feat, model_input["prompt_speech_feat"], atol=0.0, rtol=0.0)
    assert int(model_input["prompt_speech_feat_len"][0]) == ours.speech_feat.shape[1]
    # The embedding inherits the fbank difference through the (random, tiny) CAM++ graph;
    # measured max abs diff 8e-6 on embedding values up to ~5.
    torch.testing.assert_close(ours.embedding, model_input["flow_embedding"], atol=1e-4, rtol=1e-4)


def test_fbank_scale_is_upstreams(torchaudio_kaldi: types.ModuleType) -> None:
    """Upstream feeds the [-1, 1] waveform; Kaldi's int16 scale would move every value by
    log(32768²) ≈ 20.8 before mean removal. Guard that we did not rescale."""
    wav = _speechlike(16000, 1.0, 0)
    expected = torchaudio_kaldi.fbank(torch.from_numpy(wav).unsqueeze(0), num_mel_bins=80, dither=0)
    assert abs(float(kaldi_fbank(wav).mean() - expected.mean())) < FBANK_ATOL
