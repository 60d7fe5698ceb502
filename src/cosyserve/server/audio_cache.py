"""A disk cache of finished non-streaming syntheses, for requests with a fixed seed.

With a fixed seed, synthesis is deterministic: the same request on the same weights
gives the same samples, so a repeated request (a UI replaying a prompt, an agent's fixed
phrases) can skip the model. Entries hold the engine's float32 chunks, not encoded
bytes: one entry serves every response format and sample rate, encoding costs little
next to synthesis, and replaying the same chunks through the same deterministic encoder
gives byte-identical output on a hit and a miss.

One file per entry, named by the key; written to a temporary name and renamed, so a
reader sees a whole entry or none, across threads and worker processes sharing the
directory. A file's modification time is its creation (for the TTL) and its access time
its last use (for LRU eviction once the directory passes its size cap). The directory
is wiped at start, so entries never outlive the weights and settings they were made
with; the key also carries the model directory's fingerprint.

Only files this cache names are ever read or deleted: pointing it at a shared directory
(``/dev/shm``, ``/tmp``) is safe. A tmpfs is recommended: entries are small, rewritten
often, and worthless after a reboot.
"""

import contextlib
import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cosyserve.engine.async_engine import AudioChunk

logger = logging.getLogger(__name__)

_MAGIC = b"cosyserve-audio-cache 1\n"
_HEADER_LENGTH = struct.Struct("<I")
_SAMPLE = np.dtype("<f4")
_ENTRY = re.compile(r"^[0-9a-f]{64}\.audio$")
_TEMP = re.compile(r"^\.[0-9a-f]{64}\.[0-9a-f]{32}\.tmp$")
# A temporary file older than this is left over from a writer that died.
_STALE_TEMP_S = 300.0


@dataclass
class CacheStats:
    """Counters since start (per process)."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0


class AudioCache:
    """Entries under ``directory``, at most ``max_bytes`` in all, each served for ``ttl_s``
    seconds after it was made. ``namespace`` (the model fingerprint) is part of every key.
    Build with :meth:`open`, which wipes the directory. Methods do file I/O: call them off
    the event loop."""

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        ttl_s: float,
        namespace: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_bytes <= 0 or ttl_s <= 0:
            raise ValueError("max_bytes and ttl_s must be positive")
        self.directory = directory
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.namespace = namespace
        self.stats = CacheStats()
        self._clock = clock
        self._evicting = threading.Lock()

    @classmethod
    def open(
        cls,
        directory: Path,
        max_bytes: int,
        ttl_s: float,
        namespace: str,
        clock: Callable[[], float] = time.time,
    ) -> "AudioCache":
        """Create ``directory`` if needed (private to this user) and wipe its entries."""
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        cache = cls(directory, max_bytes, ttl_s, namespace, clock)
        removed = cache.wipe()
        logger.info(
            "audio cache %s: %d MiB, TTL %g s (%d old entries wiped)",
            directory,
            max_bytes >> 20,
            ttl_s,
            removed,
        )
        return cache

    def key(self, request: Mapping[str, object]) -> str:
        """The key of a request described by JSON-able values (text, voice, mode, options...)."""
        canonical = json.dumps([self.namespace, request], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def get(self, key: str) -> list[AudioChunk] | None:
        """The chunks stored under ``key``, or None (absent, expired or unreadable)."""
        path = self._path(key)
        now = self._clock()
        try:
            stat = path.stat()
            if now - stat.st_mtime > self.ttl_s:
                path.unlink(missing_ok=True)
                self.stats.misses += 1
                return None
            data = path.read_bytes()
            os.utime(path, (now, stat.st_mtime))
        except FileNotFoundError:  # absent, or evicted by another thread or process
            self.stats.misses += 1
            return None
        chunks = _decode(data)
        if chunks is None:
            logger.warning("audio cache: dropping unreadable entry %s", path.name)
            path.unlink(missing_ok=True)
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return chunks

    def put(self, key: str, chunks: Sequence[AudioChunk]) -> None:
        """Store ``chunks`` under ``key`` (atomically), then evict down to the cap. An entry
        larger than the whole cache is not stored; a failed write only logs."""
        data = _encode(chunks)
        if not chunks or len(data) > self.max_bytes:
            return
        temp = self.directory / f".{key}.{uuid.uuid4().hex}.tmp"
        now = self._clock()
        try:
            temp.write_bytes(data)
            os.utime(temp, (now, now))
            os.replace(temp, self._path(key))
        except OSError as exc:
            # A full tmpfs, or a sibling worker wiping at its start: a cache may lose entries.
            logger.warning("audio cache: entry not stored (%s)", exc.__class__.__name__)
            temp.unlink(missing_ok=True)
            return
        self.stats.stores += 1
        self._evict(now)

    def wipe(self) -> int:
        """Delete every entry (and leftover temporary file); returns how many."""
        removed = 0
        for entry in os.scandir(self.directory):
            if _ENTRY.match(entry.name) or _TEMP.match(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def size_bytes(self) -> int:
        """Bytes held by entries now."""
        return sum(entry.stat().st_size for entry in os.scandir(self.directory) if _ENTRY.match(entry.name))

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.audio"

    def _evict(self, now: float) -> None:
        """Drop expired entries and stale temporaries, then least recently used entries
        until the total is within the cap."""
        with self._evicting:
            live: list[tuple[float, int, str]] = []
            for entry in os.scandir(self.directory):
                try:
                    stat = entry.stat()
                    if _ENTRY.match(entry.name):
                        if now - stat.st_mtime > self.ttl_s:
                            os.unlink(entry.path)
                            self.stats.evictions += 1
                        else:
                            live.append((stat.st_atime, stat.st_size, entry.path))
                    elif _TEMP.match(entry.name) and now - stat.st_mtime > _STALE_TEMP_S:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    continue
            total = sum(size for _, size, _ in live)
            for _, size, path in sorted(live):
                if total <= self.max_bytes:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    self.stats.evictions += 1
                total -= size


def _encode(chunks: Sequence[AudioChunk]) -> bytes:
    """Magic, header length, JSON header (chunk lengths, speech tokens), float32 samples."""
    tokens = next((c.speech_tokens for c in chunks if c.speech_tokens is not None), None)
    header = json.dumps({"lengths": [int(c.audio.size) for c in chunks], "speech_tokens": tokens}).encode()
    samples = b"".join(np.ascontiguousarray(c.audio, dtype=_SAMPLE).tobytes() for c in chunks)
    return _MAGIC + _HEADER_LENGTH.pack(len(header)) + header + samples


def _decode(data: bytes) -> list[AudioChunk] | None:
    """:func:`_encode`'s chunks (float32, native order), or None if ``data`` is not one."""
    start = len(_MAGIC) + _HEADER_LENGTH.size
    if not data.startswith(_MAGIC) or len(data) < start:
        return None
    (length,) = _HEADER_LENGTH.unpack_from(data, len(_MAGIC))
    try:
        header = json.loads(data[start : start + length])
        lengths = [int(n) for n in header["lengths"]]
        tokens = header["speech_tokens"]
    except (ValueError, KeyError, TypeError):
        return None
    offset = start + length
    if not lengths or len(data) - offset != sum(lengths) * _SAMPLE.itemsize:
        return None
    samples = np.frombuffer(data, dtype=_SAMPLE, offset=offset).astype(np.float32)
    bounds = np.cumsum([0, *lengths])
    last = len(lengths) - 1
    return [
        AudioChunk(
            samples[bounds[i] : bounds[i + 1]],
            first=i == 0,
            speech_tokens=tuple(tokens) if i == last and tokens is not None else None,
        )
        for i in range(len(lengths))
    ]
