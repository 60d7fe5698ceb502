"""Registered voices: prompt features computed once and kept across restarts, in an SQLite
file (one machine) or a PostgreSQL database (shared by every replica)."""

from cosyserve.voices.factory import open_voice_store
from cosyserve.voices.store import (
    FEATURE_VERSION,
    VoiceInfo,
    VoiceStore,
    VoiceStoreError,
    VoiceStoreUnavailableError,
)

__all__ = [
    "FEATURE_VERSION",
    "VoiceInfo",
    "VoiceStore",
    "VoiceStoreError",
    "VoiceStoreUnavailableError",
    "open_voice_store",
]
