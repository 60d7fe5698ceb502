"""What a server process does before it loads the model: check the model directory
against its manifest, and open (wipe) the audio cache keyed by the directory's fingerprint.

Runs in the app's background start, so ``/health`` answers meanwhile; hashing the full
3.3 GB directory is the slow part (see ``verify_model`` in :mod:`cosyserve.server.settings`).
"""

from cosyserve.modeldir.preflight import check_model_dir
from cosyserve.paths import cache_dir
from cosyserve.server.audio_cache import AudioCache
from cosyserve.server.settings import Settings

# How long a cached result is served: an hour, after which its seed's audio is made anew.
AUDIO_CACHE_TTL_S = 3600.0


def prepare(settings: Settings) -> AudioCache | None:
    """Raise :class:`~cosyserve.errors.ModelDirError` (one line naming the files at fault,
    and the command that fixes it) for a missing or tampered model directory; return the
    audio cache, or None when it is off (``audio_cache_mb`` 0). Blocking: run in a thread."""
    fingerprint = check_model_dir(settings.model_dir, verify_hashes=settings.verify_model)
    if settings.audio_cache_mb == 0:
        return None
    return AudioCache.open(
        cache_dir() / "audio", settings.audio_cache_mb << 20, AUDIO_CACHE_TTL_S, fingerprint
    )
