"""Registered voices: prompt features computed once and kept across restarts."""

from cosyserve.voices.store import FEATURE_VERSION, VoiceInfo, VoiceStore, VoiceStoreError

__all__ = ["FEATURE_VERSION", "VoiceInfo", "VoiceStore", "VoiceStoreError"]
