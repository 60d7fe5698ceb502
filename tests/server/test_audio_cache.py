"""The audio cache: hits, misses, LRU and TTL eviction, safety of the directory, and
byte-identical responses through the real service (tiny model)."""

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from cosyserve.engine.async_engine import AudioChunk
from cosyserve.server.audio_cache import AudioCache
from cosyserve.server.http.app import create_app
from cosyserve.server.settings import Settings
from cosyserve.voices import VoiceStoreUnavailableError

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def chunks(seed: int, sizes: tuple[int, ...] = (2400, 4800, 0)) -> list[AudioChunk]:
    rng = np.random.default_rng(seed)
    audio = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    last = len(audio) - 1
    return [
        AudioChunk(a, first=i == 0, speech_tokens=(1, 2, 3) if i == last else None)
        for i, a in enumerate(audio)
    ]


def same(a: list[AudioChunk], b: list[AudioChunk]) -> bool:
    return [(c.audio.tobytes(), c.first, c.speech_tokens) for c in a] == [
        (c.audio.tobytes(), c.first, c.speech_tokens) for c in b
    ]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def cache(tmp_path: Path, clock: Clock) -> AudioCache:
    return AudioCache.open(tmp_path / "cache", MIB, ttl_s=60, namespace="model-a", clock=clock)


def test_miss_then_hit_returns_the_same_chunks(cache: AudioCache) -> None:
    key = cache.key({"text": "hi", "seed": 1})
    assert cache.get(key) is None
    stored = chunks(0)
    cache.put(key, stored)
    hit = cache.get(key)
    assert hit is not None and same(hit, stored)
    assert (cache.stats.hits, cache.stats.misses, cache.stats.stores) == (1, 1, 1)
    assert [p.name for p in cache.directory.iterdir()] == [f"{key}.audio"]  # no temporary left


def test_keys_depend_on_every_part_and_the_model(tmp_path: Path, cache: AudioCache) -> None:
    other_model = AudioCache(tmp_path / "other", MIB, 60, namespace="model-b")
    request = {"text": "hi", "voice": {"builtin": "a"}, "options": {"seed": 1}}
    keys = {
        cache.key(request),
        cache.key({**request, "text": "hi!"}),
        cache.key({**request, "options": {"seed": 2}}),
        cache.key({**request, "voice": {"builtin": "b"}}),
        other_model.key(request),
    }
    assert len(keys) == 5
    assert cache.key(dict(reversed(request.items()))) == cache.key(request)


def test_least_recently_used_entries_go_first(cache: AudioCache, clock: Clock) -> None:
    entry = len(chunks(0, (60_000,))[0].audio.tobytes())  # 240 kB: four fit in 1 MiB
    keys = [cache.key({"n": n}) for n in range(5)]
    for n, key in enumerate(keys[:4]):
        clock.now += 1
        cache.put(key, chunks(n, (60_000,)))
    clock.now += 1
    assert cache.get(keys[0]) is not None  # used again: now the most recent
    clock.now += 1
    cache.put(keys[4], chunks(4, (60_000,)))
    present = [cache.get(key) is not None for key in keys]
    assert present == [True, False, True, True, True]
    assert cache.size_bytes() <= cache.max_bytes and cache.stats.evictions == 1
    assert entry * 4 < cache.max_bytes < entry * 5


def test_entries_expire_after_the_ttl(cache: AudioCache, clock: Clock) -> None:
    key = cache.key({"n": 1})
    cache.put(key, chunks(1))
    clock.now += 59
    assert cache.get(key) is not None  # a hit does not extend the life of an entry
    clock.now += 2
    assert cache.get(key) is None
    assert not (cache.directory / f"{key}.audio").exists()


def test_an_entry_larger_than_the_cache_is_not_stored(cache: AudioCache) -> None:
    key = cache.key({"n": 1})
    cache.put(key, chunks(1, (300_000,)))
    assert cache.get(key) is None and cache.stats.stores == 0


def test_damaged_entries_are_dropped(cache: AudioCache) -> None:
    key = cache.key({"n": 1})
    cache.put(key, chunks(1))
    path = cache.directory / f"{key}.audio"
    path.write_bytes(path.read_bytes()[:-4])  # truncated
    assert cache.get(key) is None and not path.exists()


def test_open_wipes_only_its_own_files(tmp_path: Path, cache: AudioCache) -> None:
    cache.put(cache.key({"n": 1}), chunks(1))
    (cache.directory / f".{'a' * 64}.{'b' * 32}.tmp").write_bytes(b"left by a dead writer")
    (cache.directory / "notes.txt").write_text("not ours")
    reopened = AudioCache.open(cache.directory, MIB, 60, namespace="model-a")
    assert [p.name for p in reopened.directory.iterdir()] == ["notes.txt"]
    assert (tmp_path / "cache").stat().st_mode & 0o777 == 0o700


def test_concurrent_writers_and_readers_see_whole_entries(cache: AudioCache) -> None:
    key = cache.key({"shared": True})
    versions = [chunks(seed) for seed in range(4)]
    seen: list[list[AudioChunk] | None] = []

    def work(seed: int) -> None:
        for _ in range(20):
            cache.put(key, versions[seed])
            seen.append(cache.get(key))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen and all(got is not None and any(same(got, v) for v in versions) for got in seen)
    assert [p.name for p in cache.directory.iterdir()] == [f"{key}.audio"]


def test_invalid_limits_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="positive"):
        AudioCache(tmp_path, 0, 60, "m")


def test_through_the_service_a_hit_is_byte_identical(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One server with the cache on: a repeated seeded request is answered from the cache
    with the same bytes, in any format; unseeded and streamed requests never touch it."""
    monkeypatch.setenv("COSYSERVE_AUTH_MODE", "none")  # an open server, where access control exists
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    settings = Settings.load(
        model_dir=tiny_model_dir,
        voices_db=tmp_path / "voices.sqlite3",
        grpc_port=0,
        audio_cache_mb=16,
        profile="exact",
    )
    audio_cache_dir = tmp_path / "cache" / "cosyserve" / "audio"  # under the cache directory
    os.makedirs(audio_cache_dir)
    stale = audio_cache_dir / f"{'f' * 64}.audio"
    stale.write_bytes(b"from the previous run")
    body = {"model": "m", "input": "Hi.", "voice": "英文男", "min_tokens": 20, "max_tokens": 20}
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 120
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the server did not get ready"
            time.sleep(0.1)
        assert not stale.exists()  # wiped at start
        cache = client.app.state.runtime.service.audio_cache  # type: ignore[attr-defined]
        assert isinstance(cache, AudioCache)

        def speak(**extra: object) -> bytes:
            response = client.post("/v1/audio/speech", json={**body, **extra})
            assert response.status_code == 200, response.text
            return response.content

        miss = speak(seed=5, response_format="mp3")
        assert (cache.stats.hits, cache.stats.stores) == (0, 1)
        assert speak(seed=5, response_format="mp3") == miss
        assert speak(seed=5, response_format="wav") == speak(seed=5, response_format="wav")
        assert (cache.stats.hits, cache.stats.stores) == (3, 1)  # one entry serves every format

        speak(response_format="wav")  # no seed: neither looked up nor stored
        speak(seed=5, response_format="pcm", stream=True)  # streamed: the same
        assert (cache.stats.hits, cache.stats.misses, cache.stats.stores) == (3, 1, 1)
        assert speak(seed=6, response_format="mp3") != miss
        assert cache.stats.stores == 2

        # A built-in voice is keyed without the voice store: it still hits while a shared
        # voice database is down.
        def unavailable(name: str) -> None:
            raise VoiceStoreUnavailableError("the voice database is unavailable")

        service = client.app.state.runtime.service  # type: ignore[attr-defined]
        monkeypatch.setattr(service.voices, "get", unavailable)
        assert speak(seed=5, response_format="mp3") == miss
        assert cache.stats.hits == 4
