"""A voice: what a speaker prompt contributes to synthesis, computed once.

Upstream re-extracts prompt features for every sentence unless a speaker was saved, and
its saved speakers only work in some modes. Here every mode takes a :class:`VoicePrompt`,
whether it came from inline prompt audio, a registered voice or ``spk2info.pt``, so a
registered voice gives exactly the audio of the same prompt passed inline.

A voice serialises to a small safetensors document (:meth:`VoicePrompt.to_bytes`): the
features themselves, bit for bit, so a stored voice synthesises exactly like the original.
The features belong to the model directory that computed them (its speech tokenizer and
speaker encoder); a voice file does not record which one.
"""

import json
import re
import struct
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from cosyserve.errors import InvalidRequestError

# Voice names end up in URLs, file names and database keys: no separators, no dots.
VOICE_NAME = re.compile(r"[\w\-]{1,64}")
VOICE_FORMAT = "cosyserve-voice/1"
N_MELS = 80
EMBEDDING_DIM = 192
# safetensors: an 8-byte little-endian header length, then the JSON header.
_HEADER_LENGTH = struct.Struct("<Q")


def check_voice_name(name: str) -> None:
    """Raise :class:`InvalidRequestError` unless ``name`` is 1-64 letters, digits, '_' or '-'."""
    if not VOICE_NAME.fullmatch(name):
        raise InvalidRequestError("invalid voice name: use 1-64 letters, digits, '_' or '-'")


# Names for the usual built-in speakers of the official directories, for clients that
# cannot type them (URLs, shell scripts).
VOICE_ALIASES: tuple[tuple[str, str], ...] = (
    ("zh_female", "中文女"),
    ("zh_male", "中文男"),
    ("en_female", "英文女"),
    ("en_male", "英文男"),
)


class VoiceExistsError(InvalidRequestError):
    """A voice is registered under that name already."""

    code = "voice_exists"


@dataclass(frozen=True, eq=False)
class VoicePrompt:
    """Prompt features of one voice.

    ``prompt_text_ids``: Qwen2 ids of the normalised prompt transcript (empty if unknown).
    ``speech_tokens``: (L,) int64, 25 Hz prompt speech tokens (L = 0 for x-vector-only voices).
    ``mel``: (2L, 80) float32, 24 kHz prompt log-mel aligned to the tokens.
    ``embedding``: (192,) float32 CAM++ speaker embedding.
    """

    prompt_text_ids: tuple[int, ...]
    speech_tokens: torch.Tensor
    mel: torch.Tensor
    embedding: torch.Tensor
    name: str = ""
    audio_sha256: str = ""
    prompt_text: str = field(default="", repr=False)

    @property
    def has_audio_prompt(self) -> bool:
        """True for voices made from prompt audio; False for embedding-only (sft) speakers."""
        return int(self.speech_tokens.numel()) > 0

    @classmethod
    def from_embedding(cls, embedding: torch.Tensor, name: str) -> "VoicePrompt":
        """An ``spk2info.pt``-style speaker: an embedding only, no prompt tokens or mel."""
        return cls(
            prompt_text_ids=(),
            speech_tokens=torch.zeros(0, dtype=torch.int64),
            mel=torch.zeros(0, N_MELS, dtype=torch.float32),
            embedding=embedding.reshape(-1).to(torch.float32),
            name=name,
        )

    def to_bytes(self) -> bytes:
        """The voice as a safetensors document (tensors + string metadata); see :meth:`from_bytes`."""
        tensors = {
            "prompt_text_ids": torch.tensor(self.prompt_text_ids, dtype=torch.int64),
            "speech_tokens": self.speech_tokens.to(torch.int64).contiguous(),
            "mel": self.mel.to(torch.float32).contiguous(),
            "embedding": self.embedding.to(torch.float32).contiguous(),
        }
        metadata = {
            "format": VOICE_FORMAT,
            "name": self.name,
            "audio_sha256": self.audio_sha256,
            "prompt_text": self.prompt_text,
        }
        data: bytes = save_safetensors(tensors, metadata)
        return data

    @classmethod
    def from_bytes(cls, data: bytes) -> "VoicePrompt":
        """Read :meth:`to_bytes` output; anything else raises :class:`InvalidRequestError`."""
        try:
            tensors = load_safetensors(data)  # validates the layout before the header is read
            metadata = _metadata(data)
        except (SafetensorError, ValueError, struct.error) as exc:
            raise InvalidRequestError("voice data is not a cosyserve voice") from exc
        if metadata.get("format") != VOICE_FORMAT:
            raise InvalidRequestError("voice data is not a cosyserve voice")
        expected = {
            "prompt_text_ids": (torch.int64, 1),
            "speech_tokens": (torch.int64, 1),
            "mel": (torch.float32, 2),
            "embedding": (torch.float32, 1),
        }
        if set(tensors) != set(expected) or any(
            tensors[k].dtype != dtype or tensors[k].ndim != ndim for k, (dtype, ndim) in expected.items()
        ):
            raise InvalidRequestError("voice data is not a cosyserve voice")
        tokens, mel, embedding = tensors["speech_tokens"], tensors["mel"], tensors["embedding"]
        if (
            mel.shape[1] != N_MELS
            or embedding.shape[0] != EMBEDDING_DIM
            or (tokens.numel() == 0) != (mel.shape[0] == 0)
        ):
            raise InvalidRequestError("voice data has inconsistent feature shapes")
        if not (torch.isfinite(mel).all() and torch.isfinite(embedding).all()):
            raise InvalidRequestError("voice data has non-finite features")
        return cls(
            prompt_text_ids=tuple(int(t) for t in tensors["prompt_text_ids"].tolist()),
            speech_tokens=tokens,
            mel=mel,
            embedding=embedding,
            name=metadata.get("name", ""),
            audio_sha256=metadata.get("audio_sha256", ""),
            prompt_text=metadata.get("prompt_text", ""),
        )


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` string map of a safetensors document."""
    (length,) = _HEADER_LENGTH.unpack_from(data)
    header = json.loads(data[_HEADER_LENGTH.size : _HEADER_LENGTH.size + length])
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("malformed safetensors metadata")
    return metadata
