"""The CosyVoice 3 speech-token language model (upstream ``cosyvoice.llm.llm.CosyVoice3LM``).

CosyVoice 2's layout and passes (:class:`~cosyserve.models.speech_lm.SpeechLM`) with one
speech vocabulary of ``speech_token_size + 200`` ids (6761): the 6561 speech codes, then
sos (6561), eos (6562), task_id (6563), fill (6564) and unused ids, every one of them a
stop id. sos and task_id are rows of ``speech_embedding`` (there is no ``llm_embedding``)
and the speech head has no bias. Upstream asserts that the text holds ``<|endofprompt|>``;
that is the caller's check, this module takes any ids.
"""

import torch

from cosyserve.modeldir.hparams3 import LM3Config
from cosyserve.models.lm import QWEN2_BACKBONE_PREFIX, QWEN2_LM_HEAD_KEY, qwen2_backbone_entries
from cosyserve.models.speech_lm import SpeechLM
from cosyserve.weights.checkpoint import CheckpointTable


class CosyVoice3LM(SpeechLM[LM3Config]):
    """Qwen2 body + speech embedding (6761, H) + bias-free head H -> 6761."""

    def __init__(self, cfg: LM3Config) -> None:
        super().__init__(cfg, head_bias=False)

    def sos_and_task_id(self) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.speech_embedding.weight
        sos, task_id = self.cfg.sos, self.cfg.task_id
        return weight[sos : sos + 1], weight[task_id : task_id + 1]


def lm3_checkpoint_table(cfg: LM3Config) -> CheckpointTable:
    """Map every key of the official CosyVoice 3 ``llm.pt`` to :class:`CosyVoice3LM`'s state dict.

    As in CosyVoice 2, ``llm.model.lm_head.weight`` (Qwen2's unused text head, tied to the
    text embedding) is written as the embedding and ignored when reading.
    """
    entries = [
        *qwen2_backbone_entries(cfg.qwen),
        ("speech_embedding.weight", "speech_embedding.weight"),
        ("llm_decoder.weight", "llm_decoder.weight"),
    ]
    return CheckpointTable(
        file="llm.pt",
        entries=tuple(entries),
        aliases=((QWEN2_LM_HEAD_KEY, QWEN2_BACKBONE_PREFIX + "embed_tokens.weight"),),
    )
