"""The SQLite voice registry: exact round trips, restarts, names, concurrency, damage."""

import io
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from cosyserve.errors import InvalidRequestError
from cosyserve.pipeline.voice import VoiceExistsError, VoicePrompt
from cosyserve.voices import FEATURE_VERSION, VoiceStore, VoiceStoreError


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


def test_voices_survive_a_restart_bit_for_bit(tmp_path: Path) -> None:
    path = tmp_path / "voices.db"
    zero_shot, builtin_like = make_voice("alice"), VoicePrompt.from_embedding(torch.randn(192), "bob")
    with VoiceStore(path) as store:
        store.put(zero_shot)
        store.put(builtin_like)
    with VoiceStore(path) as store:
        assert store.names() == ["alice", "bob"]
        assert_same_voice(store.get("alice"), zero_shot)
        restored = store.get("bob")
        assert_same_voice(restored, builtin_like)
        assert restored is not None and not restored.has_audio_prompt
        assert store.get("carol") is None


def test_duplicates_are_refused_unless_replacing(tmp_path: Path) -> None:
    with VoiceStore(tmp_path / "v.db") as store:
        store.put(make_voice("alice", seed=1))
        with pytest.raises(VoiceExistsError):
            store.put(make_voice("alice", seed=2))
        assert_same_voice(store.get("alice"), make_voice("alice", seed=1))
        store.put(make_voice("alice", tokens=3, seed=2), replace=True)
        assert_same_voice(store.get("alice"), make_voice("alice", tokens=3, seed=2))
        assert store.names() == ["alice"]


def test_delete_names_and_info(tmp_path: Path) -> None:
    with VoiceStore(tmp_path / "v.db") as store:
        before = time.time()
        for name in ("zed", "Amy", "m_1", "x-y"):
            store.put(make_voice(name))
        after = time.time()
        assert store.names() == sorted(["zed", "Amy", "m_1", "x-y"])
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


@pytest.mark.parametrize("name", ["../etc", "a/b", "a.b", "", "x" * 65, "a b", "a\\b"])
def test_names_with_path_characters_are_rejected(tmp_path: Path, name: str) -> None:
    with VoiceStore(tmp_path / "v.db") as store:
        with pytest.raises(InvalidRequestError, match="invalid voice name"):
            store.put(make_voice(name))
        for call in (store.get, store.delete, store.info):
            with pytest.raises(InvalidRequestError, match="invalid voice name"):
                call(name)
        assert store.names() == []


def test_database_is_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "v.db"
    with VoiceStore(path):
        probe = sqlite3.connect(path)
        try:
            assert probe.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        finally:
            probe.close()


def test_concurrent_use_from_threads(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    with VoiceStore(tmp_path / "v.db") as store:

        def worker(index: int) -> None:
            try:
                for j in range(8):
                    voice = make_voice(f"t{index}_{j}", tokens=2, seed=index * 100 + j)
                    store.put(voice)
                    assert_same_voice(store.get(voice.name), voice)
                    store.names()
            except BaseException as exc:  # collected and re-raised in the test thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert len(store.names()) == 32


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "v.db"
    path.write_bytes(b"this is not an SQLite file at all" * 100)
    with pytest.raises(VoiceStoreError, match="cannot open the voice database"):
        VoiceStore(path)


def test_a_foreign_sqlite_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE voices (name TEXT, data BLOB)")
    conn.commit()
    conn.close()
    with pytest.raises(VoiceStoreError, match="not a cosyserve voice database"):
        VoiceStore(path)


def test_a_directory_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(VoiceStoreError, match="cannot open the voice database"):
        VoiceStore(tmp_path)


def _tamper(path: Path, sql: str, *args: object) -> None:
    conn = sqlite3.connect(path)
    conn.execute(sql, args)
    conn.commit()
    conn.close()


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
)
def test_corrupt_rows_give_a_clear_error(tmp_path: Path, column: str, value: object) -> None:
    path = tmp_path / "v.db"
    with VoiceStore(path) as store:
        store.put(make_voice("alice"))
        store.put(make_voice("bob"))
    _tamper(path, f"UPDATE voices SET {column} = ? WHERE name = 'alice'", value)
    with VoiceStore(path) as store:
        with pytest.raises(VoiceStoreError, match="stored voice 'alice' is corrupt"):
            store.get("alice")
        assert store.get("bob") is not None  # one bad row does not break the others
        assert store.delete("alice") is True


def test_voices_of_another_feature_version_must_be_registered_again(tmp_path: Path) -> None:
    path = tmp_path / "v.db"
    with VoiceStore(path) as store:
        store.put(make_voice("alice"))
    _tamper(path, "UPDATE voices SET feature_version = ?", FEATURE_VERSION + 1)
    with VoiceStore(path) as store, pytest.raises(VoiceStoreError, match="register it again"):
        store.get("alice")
