"""Both voice stores, SQLite and PostgreSQL, by the same tests: exact round trips, restarts,
names, threads, several stores on one database, damage. SQLite's own checks are at the end."""

import dataclasses
import io
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyserve.errors import InvalidRequestError
from cosyserve.pipeline.voice import VoiceExistsError, VoicePrompt
from cosyserve.voices import FEATURE_VERSION, VoiceStore, VoiceStoreError
from cosyserve.voices.sqlite import SqliteVoiceStore
from tests.voices.conftest import Backend


def make_voice(name: str, tokens: int = 7, seed: int = 0) -> VoicePrompt:
    gen = torch.Generator().manual_seed(seed)
    mel = torch.randn(2 * tokens, 80, generator=gen)
    # Values a lossy or text round trip would change: signed zero, NaN, subnormal, extremes.
    mel[0, :4] = torch.tensor([-0.0, float("nan"), 1e-45, torch.finfo(torch.float32).max])
    return VoicePrompt(
        prompt_text_ids=(151643, 7, 0, 2**40),
        speech_tokens=torch.randint(0, 6561, (tokens,), generator=gen),
        mel=mel,
        embedding=torch.randn(192, generator=gen),
        name=name,
        audio_sha256="ab" * 32,
        prompt_text="希望你以后能够做的比我还好呦。",
    )


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.numpy().tobytes() == b.numpy().tobytes()


def assert_same_voice(got: VoicePrompt | None, want: VoicePrompt) -> None:
    assert got is not None
    assert got.prompt_text_ids == want.prompt_text_ids
    for field in ("speech_tokens", "mel", "embedding"):
        assert_same_bits(getattr(got, field), getattr(want, field))
    assert (got.name, got.audio_sha256, got.prompt_text) == (want.name, want.audio_sha256, want.prompt_text)


def run_threads(count: int, work: Callable[[int], None]) -> list[BaseException]:
    """Run ``work(0..count-1)`` on threads started together; what they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def body(index: int) -> None:
        try:
            start.wait()
            work(index)
        except BaseException as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def test_voices_survive_a_restart_bit_for_bit(backend: Backend) -> None:
    zero_shot, builtin_like = make_voice("alice"), VoicePrompt.from_embedding(torch.randn(192), "bob")
    with backend.open() as store:
        store.put(zero_shot)
        store.put(builtin_like)
    with backend.open() as store:
        assert store.names() == ["alice", "bob"]
        assert_same_voice(store.get("alice"), zero_shot)
        restored = store.get("bob")
        assert_same_voice(restored, builtin_like)
        assert restored is not None and not restored.has_audio_prompt
        assert store.get("carol") is None


def test_duplicates_are_refused_unless_replacing(store: VoiceStore) -> None:
    store.put(make_voice("alice", seed=1))
    with pytest.raises(VoiceExistsError):
        store.put(make_voice("alice", seed=2))
    assert_same_voice(store.get("alice"), make_voice("alice", seed=1))
    store.put(make_voice("alice", tokens=3, seed=2), replace=True)
    assert_same_voice(store.get("alice"), make_voice("alice", tokens=3, seed=2))
    assert store.names() == ["alice"]


def test_delete_names_and_info(store: VoiceStore) -> None:
    before = time.time()
    for name in ("zed", "Amy", "m_1", "x-y", "_z", "-a", "Zoe", "9"):
        store.put(make_voice(name))
    after = time.time()
    # Code point order in both stores, whatever the PostgreSQL database's collation.
    assert store.names() == sorted(["zed", "Amy", "m_1", "x-y", "_z", "-a", "Zoe", "9"])
    info = store.info("m_1")
    assert info is not None
    assert (info.name, info.prompt_text, info.audio_sha256) == (
        "m_1",
        "希望你以后能够做的比我还好呦。",
        "ab" * 32,
    )
    assert before <= info.created_at <= after
    assert [i.name for i in store.list_info()] == store.names()
    assert store.delete("zed") is True
    assert store.delete("zed") is False
    assert store.info("zed") is None and store.get("zed") is None
    assert "zed" not in store.names()


def test_names_with_path_characters_are_rejected(store: VoiceStore) -> None:
    for name in ("../etc", "a/b", "a.b", "", "x" * 65, "a b", "a\\b", "a'; DROP TABLE voices; --"):
        with pytest.raises(InvalidRequestError, match="invalid voice name"):
            store.put(make_voice(name))
        for call in (store.get, store.delete, store.info):
            with pytest.raises(InvalidRequestError, match="invalid voice name"):
                call(name)
    assert store.names() == []


def test_a_transcript_with_a_nul_character_is_refused(store: VoiceStore) -> None:
    voice = dataclasses.replace(make_voice("alice"), prompt_text="hello\x00there")
    with pytest.raises(InvalidRequestError, match="NUL character"):
        store.put(voice)
    assert store.names() == []


def test_concurrent_use_from_threads(store: VoiceStore) -> None:
    def work(index: int) -> None:
        for j in range(8):
            voice = make_voice(f"t{index}_{j}", tokens=2, seed=index * 100 + j)
            store.put(voice)
            assert_same_voice(store.get(voice.name), voice)
            store.names()

    assert run_threads(4, work) == []
    assert len(store.names()) == 32


def test_stores_on_one_database_share_voices_and_one_put_wins(backend: Backend) -> None:
    """Two stores on one database, as two server replicas have: each sees the other's
    writes at once, and of puts of one name at the same moment exactly one wins."""
    with backend.open() as first, backend.open() as second:
        first.put(make_voice("alice", seed=1))
        assert_same_voice(second.get("alice"), make_voice("alice", seed=1))
        assert second.names() == ["alice"] and second.info("alice") is not None
        assert second.delete("alice") is True
        assert first.get("alice") is None and first.names() == []

        stores = (first, second)
        won: list[int] = []

        def race(index: int) -> None:
            try:
                stores[index % 2].put(make_voice("bob", seed=index))
                won.append(index)
            except VoiceExistsError:
                pass

        assert run_threads(6, race) == []
        assert len(won) == 1
        for store in stores:
            assert_same_voice(store.get("bob"), make_voice("bob", seed=won[0]))


def test_stores_opened_at_once_on_a_new_database_all_work(backend: Backend) -> None:
    """Replicas that start together on an empty database create its table once."""
    opened: list[VoiceStore] = []
    try:
        assert run_threads(4, lambda _: opened.append(backend.open())) == []
        assert len(opened) == 4
        opened[0].put(make_voice("alice"))
        assert [store.names() for store in opened] == [["alice"]] * 4
    finally:
        for store in opened:
            store.close()


def test_a_closed_store_refuses_calls(backend: Backend) -> None:
    store = backend.open()
    store.close()
    calls = (store.names, store.list_info, lambda: store.get("a"), lambda: store.put(make_voice("a")))
    for call in calls:
        with pytest.raises(VoiceStoreError, match="the voice store is closed"):
            call()


def test_a_foreign_voices_table_is_refused(backend: Backend) -> None:
    backend.execute("CREATE TABLE {table} (name TEXT, data TEXT)")
    with pytest.raises(VoiceStoreError, match="not a cosyserve voice database"):
        backend.open()


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("mel", b"\x93NUMPY garbage"),
        ("mel", _npy(np.zeros((4, 80), dtype=np.float64))),  # wrong dtype
        ("embedding", _npy(np.zeros((2, 96), dtype=np.float32))),  # wrong rank
        ("speech_tokens", "text, not a blob"),
        ("prompt_text_ids", _npy(np.array([{"a": 1}], dtype=object))),  # would need pickle
    ],
    ids=["garbage", "wrong_dtype", "wrong_rank", "text", "pickle"],
)
def test_corrupt_rows_give_a_clear_error(backend: Backend, column: str, value: object) -> None:
    with backend.open() as store:
        store.put(make_voice("alice"))
        store.put(make_voice("bob"))
    backend.execute(f"UPDATE {{table}} SET {column} = ? WHERE name = 'alice'", value)
    with backend.open() as store:
        with pytest.raises(VoiceStoreError, match="stored voice 'alice' is corrupt"):
            store.get("alice")
        assert store.get("bob") is not None  # one bad row does not break the others
        assert store.delete("alice") is True


def test_voices_of_another_feature_version_must_be_registered_again(backend: Backend) -> None:
    with backend.open() as store:
        store.put(make_voice("alice"))
    backend.execute("UPDATE {table} SET feature_version = ?", FEATURE_VERSION + 1)
    with backend.open() as store, pytest.raises(VoiceStoreError, match="register it again"):
        store.get("alice")


# -- SQLite only: the file -----------------------------------------------------------------


def test_sqlite_database_is_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "v.db"
    with SqliteVoiceStore(path):
        probe = sqlite3.connect(path)
        try:
            assert probe.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        finally:
            probe.close()


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "v.db"
    path.write_bytes(b"this is not an SQLite file at all" * 100)
    with pytest.raises(VoiceStoreError, match="cannot open the voice database"):
        SqliteVoiceStore(path)


def test_a_directory_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(VoiceStoreError, match="cannot open the voice database"):
        SqliteVoiceStore(tmp_path)
