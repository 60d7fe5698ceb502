"""Each model family's voices apart in one store (``VoiceStore.for_family``), on both
stores: CosyVoice 2's are the store's own table, as before; another family's live in a
table of their own that shares the store's connections."""

import pytest

from cosyserve.pipeline.voice import VoiceExistsError
from cosyserve.voices import VoiceStoreError
from tests.voices.conftest import Backend
from tests.voices.test_store import assert_same_voice, make_voice


def test_families_keep_their_own_voices(backend: Backend) -> None:
    with backend.open() as store:
        assert store.for_family("cosyvoice2") is store
        store.put(make_voice("old", seed=1))  # stored before a second family was served
        cv3 = store.for_family("cosyvoice3")
        assert cv3.names() == [] and cv3.get("old") is None
        cv3.put(make_voice("both", seed=2))
        store.put(make_voice("both", seed=3))
        assert_same_voice(cv3.get("both"), make_voice("both", seed=2))
        assert_same_voice(store.get("both"), make_voice("both", seed=3))
        assert (store.names(), cv3.names()) == (["both", "old"], ["both"])
        assert [info.name for info in cv3.list_info()] == ["both"] and cv3.info("old") is None
        with pytest.raises(VoiceExistsError):
            cv3.put(make_voice("both"))
        assert cv3.delete("both") and not cv3.delete("both")
        assert store.get("both") is not None
        cv3.put(make_voice("kept", seed=4))
        cv3.close()  # a view's close leaves the store open
        assert store.names() == ["both", "old"]
    with backend.open() as reopened:  # kept across restarts, and the table is found again
        assert_same_voice(reopened.for_family("cosyvoice3").get("kept"), make_voice("kept", seed=4))
        assert_same_voice(reopened.get("old"), make_voice("old", seed=1))
        view = reopened.for_family("cosyvoice3")
    with pytest.raises(VoiceStoreError, match="closed"):
        view.names()  # its store is closed
    with backend.open() as store, pytest.raises(ValueError, match="family"):
        store.for_family("../x")
