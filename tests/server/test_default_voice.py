"""Which voice a request without one gets: the default_voice setting, else the first
built-in speaker, else a 400 that says how to add one. One place decides, for every route."""

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cosyserve.engine.loader import LoadedModel, load_model
from cosyserve.errors import InvalidRequestError
from cosyserve.pipeline.frontend import UnknownSpeakerError
from cosyserve.pipeline.voice import VoicePrompt
from cosyserve.server.service import SpeechParams, SpeechService
from cosyserve.voices import VoiceStore
from cosyserve.voices.sqlite import SqliteVoiceStore


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[VoiceStore]:
    voices = SqliteVoiceStore(tmp_path / "voices.sqlite3")
    yield voices
    voices.close()


def _voice(model: LoadedModel, store: VoiceStore, default: str = "") -> VoicePrompt:
    """The voice of a request that names none (no engine needed to resolve it)."""
    engine: Any = None  # resolving a voice runs no synthesis
    service = SpeechService(model, engine, store, frontend_threads=1, default_voice=default)
    try:
        return service._request(SpeechParams(text="你好。")).voice
    finally:
        service.close()


def _same(a: VoicePrompt, b: VoicePrompt) -> bool:
    return torch.equal(a.embedding, b.embedding)


def test_the_first_built_in_speaks_by_default(model: LoadedModel, store: VoiceStore) -> None:
    first = next(iter(model.speakers))
    assert torch.equal(_voice(model, store).embedding, model.speakers[first])


def test_the_setting_names_a_built_in_an_alias_or_a_registered_voice(
    model: LoadedModel, store: VoiceStore
) -> None:
    assert torch.equal(_voice(model, store, "英文男").embedding, model.speakers["英文男"])
    assert torch.equal(_voice(model, store, "zh_female").embedding, model.speakers["中文女"])
    mine = VoicePrompt.from_embedding(torch.randn(model.hparams.flow.spk_embed_dim), "mine")
    store.put(mine)
    assert _same(_voice(model, store, "mine"), mine)


def test_an_unknown_default_is_the_unknown_voice_error(model: LoadedModel, store: VoiceStore) -> None:
    with pytest.raises(UnknownSpeakerError, match="nobody"):
        _voice(model, store, "nobody")


def test_no_voice_anywhere_says_how_to_add_one(model: LoadedModel, store: VoiceStore) -> None:
    silent = dataclasses.replace(model, speakers={})
    with pytest.raises(InvalidRequestError, match=r"POST /v1/audio/voices\) or set default_voice"):
        _voice(silent, store)
