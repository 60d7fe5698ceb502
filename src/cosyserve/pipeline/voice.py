"""A voice: what a speaker prompt contributes to synthesis, computed once.

Upstream re-extracts prompt features for every sentence unless a speaker was saved, and
its saved speakers only work in some modes. Here every mode takes a :class:`VoicePrompt`,
whether it came from inline prompt audio, a registered voice or ``spk2info.pt``, so a
registered voice gives exactly the audio of the same prompt passed inline.
"""

from dataclasses import dataclass, field

import torch


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
            mel=torch.zeros(0, 80, dtype=torch.float32),
            embedding=embedding.reshape(-1).to(torch.float32),
            name=name,
        )
