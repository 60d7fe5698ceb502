"""A registered voice as one database row, the same in every store.

======================  ==============================================================
column                  content
======================  ==============================================================
name                    primary key; 1-64 letters, digits, ``_`` or ``-``
prompt_text             the normalised transcript ("" for cross-lingual-only voices)
prompt_text_ids         ``.npy`` (T,) int64, Qwen2 ids of ``prompt_text``
speech_tokens           ``.npy`` (L,) int64, 25 Hz prompt speech tokens
mel                     ``.npy`` (2L, 80) float32, 24 kHz prompt log-mel
embedding               ``.npy`` (192,) float32, CAM++ speaker embedding
audio_sha256            hex SHA-256 of the prompt file as uploaded
created_at              Unix seconds of registration
feature_version         :data:`~cosyserve.voices.store.FEATURE_VERSION` when the features were computed
======================  ==============================================================

Arrays are NumPy ``.npy`` bytes, read with ``allow_pickle=False``: a database can never
make the server run code, and values come back bit for bit.
"""

import io
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray

from cosyserve.errors import InvalidRequestError
from cosyserve.pipeline.voice import VoicePrompt
from cosyserve.voices.store import FEATURE_VERSION, VoiceInfo, VoiceStoreError

logger = logging.getLogger(__name__)

COLUMNS = (
    "name",
    "prompt_text",
    "prompt_text_ids",
    "speech_tokens",
    "mel",
    "embedding",
    "audio_sha256",
    "created_at",
    "feature_version",
)
COLUMN_LIST = ", ".join(COLUMNS)
# What :func:`info_from_row` reads.
INFO_COLUMN_LIST = "name, prompt_text, audio_sha256, created_at"


def row_of(voice: VoicePrompt) -> tuple[object, ...]:
    """``voice`` as the values of :data:`COLUMNS`, registered now.
    :class:`~cosyserve.errors.InvalidRequestError` for a transcript with a NUL character,
    which PostgreSQL's text cannot hold (refused by every store, so that they behave alike;
    the frontend's text clean-up removes NULs before a transcript gets here)."""
    if "\x00" in voice.prompt_text:
        raise InvalidRequestError("the transcript contains a NUL character")
    return (
        voice.name,
        voice.prompt_text,
        _to_npy(np.asarray(voice.prompt_text_ids, dtype=np.int64)),
        _to_npy(voice.speech_tokens.detach().to("cpu", torch.int64).reshape(-1).numpy()),
        _to_npy(voice.mel.detach().to("cpu", torch.float32).numpy()),
        _to_npy(voice.embedding.detach().to("cpu", torch.float32).reshape(-1).numpy()),
        voice.audio_sha256,
        time.time(),
        FEATURE_VERSION,
    )


def voice_from_row(row: Sequence[Any]) -> VoicePrompt:
    """The voice of a row of :data:`COLUMNS`; :class:`VoiceStoreError` if it is damaged or
    of another :data:`~cosyserve.voices.store.FEATURE_VERSION`."""
    name, prompt_text, text_ids, tokens, mel, embedding, sha256, _, version = row
    if version != FEATURE_VERSION:
        raise VoiceStoreError(
            f"voice {name!r} was stored with feature format {version} and this server reads"
            f" {FEATURE_VERSION}; delete it and register it again"
        )
    try:
        ids = _from_npy(text_ids, np.int64, 1)
        voice = VoicePrompt(
            prompt_text_ids=tuple(int(i) for i in ids.tolist()),
            speech_tokens=torch.from_numpy(_from_npy(tokens, np.int64, 1)),
            mel=torch.from_numpy(_from_npy(mel, np.float32, 2)),
            embedding=torch.from_numpy(_from_npy(embedding, np.float32, 1)),
            name=str(name),
            audio_sha256=str(sha256),
            prompt_text=str(prompt_text),
        )
    except (ValueError, OSError, EOFError) as exc:
        logger.error("stored voice %r is corrupt: %s", name, exc)
        raise VoiceStoreError(f"stored voice {name!r} is corrupt; delete it and register it again") from None
    return voice


def info_from_row(row: Sequence[Any]) -> VoiceInfo:
    """The :class:`VoiceInfo` of a row of :data:`INFO_COLUMN_LIST`."""
    name, prompt_text, sha256, created_at = row
    return VoiceInfo(str(name), str(prompt_text), str(sha256), float(created_at))


def _to_npy(array: NDArray[np.generic]) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def _from_npy(blob: object, dtype: type[np.generic], ndim: int) -> NDArray[np.generic]:
    if not isinstance(blob, bytes):
        raise ValueError(f"expected bytes, found {type(blob).__name__}")
    array = np.load(io.BytesIO(blob), allow_pickle=False)
    if array.dtype != np.dtype(dtype) or array.ndim != ndim:
        raise ValueError(f"expected {ndim}-D {np.dtype(dtype)}, found {array.ndim}-D {array.dtype}")
    # np.load may hand back a read-only view of the blob; torch tensors must own writable memory.
    return np.array(array, copy=True)
