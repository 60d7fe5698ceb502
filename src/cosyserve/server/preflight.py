"""What a server process does before it loads the models: check each model directory
against its manifest, and open (wipe) the audio cache keyed by the directory's fingerprint.

Runs in the app's background start, so ``/health`` answers meanwhile. Hashing the full
3.3 GB directory (``verify_model`` in :mod:`cosyserve.server.settings`) is the slow part,
so :func:`prepare` checks only which files are there and :func:`verify` hashes them while
the model loads (:meth:`~cosyserve.server.runtime.ServerRuntime.start`).
"""

import hashlib
import logging
import time
from dataclasses import dataclass

from cosyserve.modeldir.layout import MANIFEST_FILE
from cosyserve.modeldir.preflight import check_model_dir
from cosyserve.paths import cache_dir
from cosyserve.server.audio_cache import AudioCache
from cosyserve.server.settings import Settings

logger = logging.getLogger(__name__)

# How long a cached result is served: an hour, after which its seed's audio is made anew.
AUDIO_CACHE_TTL_S = 3600.0


@dataclass(frozen=True)
class Prepared:
    """The model directories' fingerprints (one each, in ``model_dir``'s order), which key
    what is derived from their files (the audio cache, the traces a server keeps), and the
    audio cache (None when ``audio_cache_mb`` is 0)."""

    fingerprints: tuple[str, ...]
    audio_cache: AudioCache | None

    @property
    def fingerprint(self) -> str:
        """The first (default) model's fingerprint."""
        return self.fingerprints[0]


def prepare(settings: Settings) -> Prepared:
    """Raise :class:`~cosyserve.errors.ModelDirError` (one line naming the files at fault,
    and the command that fixes it) for a missing directory or a file missing from or not
    in its manifest (their contents are :func:`verify`'s). Blocking: run in a thread."""
    fingerprints = tuple(check_model_dir(path, verify_hashes=False) for path in settings.model_dir)
    if settings.audio_cache_mb == 0:
        return Prepared(fingerprints, None)
    # One model: its own fingerprint, as before several could be served. Several: all of
    # theirs (a cache key names its model).
    combined = (
        fingerprints[0]
        if len(fingerprints) == 1
        else hashlib.sha256("\n".join(fingerprints).encode()).hexdigest()
    )
    cache = AudioCache.open(cache_dir() / "audio", settings.audio_cache_mb << 20, AUDIO_CACHE_TTL_S, combined)
    return Prepared(fingerprints, cache)


def verify(settings: Settings) -> None:
    """With ``verify_model`` and a manifest, raise :class:`~cosyserve.errors.ModelDirError`
    for a file whose sha256 differs from it (tampered, truncated). Blocking: run in a thread."""
    if not settings.verify_model:
        return
    for path in settings.model_dir:
        if not (path / MANIFEST_FILE).is_file():
            continue
        start = time.perf_counter()
        check_model_dir(path)
        logger.info("model files of %s verified in %.1f s", path.name, time.perf_counter() - start)
