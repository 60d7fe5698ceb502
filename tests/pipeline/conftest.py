"""A synthesizer over the session's tiny model, shared by the pipeline tests.

Tests may register voices on it (under names of their own) but must leave its engine idle.
"""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.pipeline.synthesizer import Synthesizer
from cosyserve.pipeline.voice import VoicePrompt
from tests.pipeline.prompts import PROMPT_TEXT, PROMPT_TOKENS, prompt_wav


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """Run the tiny models on one intra-op thread. Their ops are too small to split, and on
    a shared 2-core machine two OpenMP threads that wait for each other made every flow
    and HiFT call 10-25x slower (measured: 0.08 s vs 1-4 s per tiny flow call)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


@pytest.fixture(scope="session")
def synth(tiny_model: LoadedModel) -> Synthesizer:
    return Synthesizer(tiny_model)


@pytest.fixture(scope="session")
def voice(synth: Synthesizer) -> VoicePrompt:
    """The standard test prompt with its transcript (20 prompt tokens)."""
    made = synth.voice_from_audio(prompt_wav(), PROMPT_TEXT)
    assert made.speech_tokens.shape == (PROMPT_TOKENS,)
    return made


@pytest.fixture(autouse=True)
def _engine_left_idle(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "synth" in request.fixturenames:
        engine = request.getfixturevalue("synth").engine
        assert not engine.has_work(), "a test left a request in the shared engine"
