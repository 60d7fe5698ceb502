"""What a server process does before it loads the model: check the model directory
against its manifest, and open (wipe) the audio cache keyed by the directory's fingerprint.

Runs in the app's background start, so ``/health`` answers meanwhile. Hashing the full
3.3 GB directory (``verify_model`` in :mod:`cosyserve.server.settings`) is the slow part,
so :func:`prepare` checks only which files are there and :func:`verify` hashes them while
the model loads (:meth:`~cosyserve.server.runtime.ServerRuntime.start`).
"""

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
    """The model directory's fingerprint, which keys what is derived from its files (the
    audio cache, the traces a server keeps), and the audio cache (None when
    ``audio_cache_mb`` is 0)."""

    fingerprint: str
    audio_cache: AudioCache | None


def prepare(settings: Settings) -> Prepared:
    """Raise :class:`~cosyserve.errors.ModelDirError` (one line naming the files at fault,
    and the command that fixes it) for a missing directory or a file missing from or not
    in its manifest (their contents are :func:`verify`'s). Blocking: run in a thread."""
    fingerprint = check_model_dir(settings.model_dir, verify_hashes=False)
    if settings.audio_cache_mb == 0:
        return Prepared(fingerprint, None)
    cache = AudioCache.open(
        cache_dir() / "audio", settings.audio_cache_mb << 20, AUDIO_CACHE_TTL_S, fingerprint
    )
    return Prepared(fingerprint, cache)


def verify(settings: Settings) -> None:
    """With ``verify_model`` and a manifest, raise :class:`~cosyserve.errors.ModelDirError`
    for a file whose sha256 differs from it (tampered, truncated). Blocking: run in a thread."""
    if not settings.verify_model or not (settings.model_dir / MANIFEST_FILE).is_file():
        return
    start = time.perf_counter()
    check_model_dir(settings.model_dir)
    logger.info("model files verified in %.1f s", time.perf_counter() - start)
