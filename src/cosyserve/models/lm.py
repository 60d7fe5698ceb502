"""The CosyVoice 2 speech-token language model (upstream ``cosyvoice.llm.llm.Qwen2LM``).

A Qwen2 body reads ``[sos] + text embeddings + [task_id] + prompt speech embeddings``
and then its own speech tokens; a 6564-way head (6561 speech tokens + eos 6561, 6562 and
fill 6563) predicts the next one. sos and task_id are the two rows of ``llm_embedding``.
The passes are :class:`~cosyserve.models.speech_lm.SpeechLM`'s, shared with CosyVoice 3.
"""

import torch

from cosyserve.modeldir.hparams import LMConfig, Qwen2Config
from cosyserve.models.embedding import embedding
from cosyserve.models.speech_lm import SpeechLM, qwen2_layer_keys
from cosyserve.weights.checkpoint import CheckpointTable

SOS_ROW = 0  # row of llm_embedding that opens the sequence
TASK_ID_ROW = 1  # row of llm_embedding between the text and the speech tokens

# Qwen2Encoder.model (a Qwen2ForCausalLM) .model (its body); the same in CosyVoice 3.
QWEN2_BACKBONE_PREFIX = "llm.model.model."
# The unused text head of Qwen2ForCausalLM, tied to the text embedding.
QWEN2_LM_HEAD_KEY = "llm.model.lm_head.weight"


class CosyVoice2LM(SpeechLM[LMConfig]):
    """Qwen2 body + CosyVoice 2 speech embedding, biased head and ``llm_embedding`` (2, H)."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__(cfg, head_bias=True)
        self.llm_embedding = embedding(2, cfg.qwen.hidden_size)

    def sos_and_task_id(self) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.llm_embedding.weight
        return weight[SOS_ROW : SOS_ROW + 1], weight[TASK_ID_ROW : TASK_ID_ROW + 1]


def qwen2_backbone_entries(qwen: Qwen2Config) -> list[tuple[str, str]]:
    """Checkpoint entries (official key, our key) of the Qwen2 body inside an ``llm.pt``."""
    entries = [(QWEN2_BACKBONE_PREFIX + "embed_tokens.weight", "qwen.embed_tokens.weight")]
    for i in range(qwen.num_hidden_layers):
        entries += [
            (f"{QWEN2_BACKBONE_PREFIX}layers.{i}.{key}", f"qwen.layers.{i}.{key}")
            for key in qwen2_layer_keys()
        ]
    entries.append((QWEN2_BACKBONE_PREFIX + "norm.weight", "qwen.norm.weight"))
    return entries


def lm_checkpoint_table(cfg: LMConfig) -> CheckpointTable:
    """Map every key of the official ``llm.pt`` to :class:`CosyVoice2LM`'s state dict.

    ``llm.model.lm_head.weight`` (the unused text head, tied to the text embedding in the
    released model) is an alias of the embedding: written as the same tensor, accepted
    and ignored when reading.
    """
    entries = [("llm_embedding.weight", "llm_embedding.weight"), *qwen2_backbone_entries(cfg.qwen)]
    entries += [
        ("speech_embedding.weight", "speech_embedding.weight"),
        ("llm_decoder.weight", "llm_decoder.weight"),
        ("llm_decoder.bias", "llm_decoder.bias"),
    ]
    return CheckpointTable(
        file="llm.pt",
        entries=tuple(entries),
        aliases=((QWEN2_LM_HEAD_KEY, QWEN2_BACKBONE_PREFIX + "embed_tokens.weight"),),
    )
