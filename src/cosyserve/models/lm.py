"""The CosyVoice 2 speech-token language model (upstream ``cosyvoice.llm.llm.Qwen2LM``).

A Qwen2 body reads ``[sos] + text embeddings + [task_id] + prompt speech embeddings``
and then its own speech tokens; a 6564-way head (6561 speech tokens + eos 6561, 6562 and
fill 6563) predicts the next one. The model holds weights only: each sequence's state
lives in its :class:`~cosyserve.models.kv_cache.KVCache` slot.
"""

from collections.abc import Sequence

import torch
from torch import nn

from cosyserve.errors import InvalidRequestError, ModelDirError
from cosyserve.modeldir.hparams import LMConfig
from cosyserve.models.embedding import embedding
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.qwen2 import Qwen2Model
from cosyserve.weights.checkpoint import CheckpointTable

SOS_ROW = 0  # row of llm_embedding that opens the sequence
TASK_ID_ROW = 1  # row of llm_embedding between the text and the speech tokens

_BACKBONE = "llm.model.model."  # Qwen2Encoder.model (a Qwen2ForCausalLM) .model (its body)


class CosyVoice2LM(nn.Module):
    """Qwen2 body + CosyVoice 2 speech embedding and head. H = ``cfg.qwen.hidden_size``."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        hidden = cfg.qwen.hidden_size
        if not cfg.llm_input_size == cfg.llm_output_size == hidden:
            raise ModelDirError(
                f"llm_input_size ({cfg.llm_input_size}) and llm_output_size ({cfg.llm_output_size}) "
                f"must equal the Qwen2 hidden_size ({hidden})"
            )
        self.cfg = cfg
        self.num_speech_ids = cfg.speech_token_size + 3
        self.llm_embedding = embedding(2, hidden)
        self.qwen = Qwen2Model(cfg.qwen)
        self.speech_embedding = embedding(self.num_speech_ids, hidden)
        self.llm_decoder = nn.Linear(hidden, self.num_speech_ids, bias=True)

    def prompt_embeddings(self, text_ids: torch.Tensor, prompt_speech_ids: torch.Tensor) -> torch.Tensor:
        """The prefill input ``[sos] + embed(text_ids) + [task_id] + speech_emb(prompt_speech_ids)``.

        ``text_ids``: (T_text,) long Qwen2 ids, the prompt text followed by the text to
        speak. ``prompt_speech_ids``: (T_p,) long speech tokens < 6561 (empty without a
        voice prompt). Returns (T_text + 2 + T_p, H) in the model's dtype.
        """
        _check_ids(text_ids, self.cfg.qwen.vocab_size, "text token")
        _check_ids(prompt_speech_ids, self.cfg.speech_token_size, "prompt speech token")
        sos = self.llm_embedding.weight[SOS_ROW : SOS_ROW + 1]
        task_id = self.llm_embedding.weight[TASK_ID_ROW : TASK_ID_ROW + 1]
        return torch.cat(
            [sos, self.qwen.embed_tokens(text_ids), task_id, self.speech_embedding(prompt_speech_ids)]
        )

    def lay_out_head_for_decode_(self) -> None:
        """Store the float32 speech head's weight (6564, H) column-major, the same values.

        ``F.linear`` multiplies by the weight's transpose, which is then contiguous: for the
        1-2 rows of a decode step torch's CPU float32 kernel reads it about twice as fast
        as the row-major weight, which takes 5-10 % off a whole decode step of one or two
        rows and costs nothing at batch 8. Other dtypes showed no difference and are left
        as they are."""
        weight = getattr(self.llm_decoder, "weight", None)  # an int8 head has none
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.device.type == "cpu":
            self.llm_decoder.weight = nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)

    def speech_log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head on final hidden states (..., H): float32 log-probs (..., 6564)."""
        rows = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
        n = rows.shape[0]
        if n == 1 and isinstance(self.llm_decoder, nn.Linear):
            # One row takes the matrix-vector kernel, whose sums differ from the matrix
            # kernel's (by about 1e-7): with a copy beside it, a row gets the same log-probs
            # alone as in any batch, for 0.2 ms of a batch-1 step. An int8 head's rows are
            # their own in any batch (quantize.Int8DynamicLinear).
            rows = rows.repeat(2, 1)
        logits: torch.Tensor = self.llm_decoder(rows)[:n]
        return logits.float().log_softmax(-1).view(*hidden.shape[:-1], -1)

    def prefill(self, embeddings: torch.Tensor, slot: int, cache: KVCache) -> torch.Tensor:
        """Append ``embeddings`` (T, H) to the sequence in ``slot`` (empty for a new request,
        or holding earlier chunks of the same prompt). Returns the speech log-probs of the
        last position, (6564,) float32."""
        step = cache.begin([slot], embeddings.shape[0])
        hidden = self.qwen(embeddings[None], step)  # (1, T, H)
        cache.commit(step)
        return self.speech_log_probs(hidden[0, -1])

    def decode(self, tokens: torch.Tensor, slots: Sequence[int], cache: KVCache) -> torch.Tensor:
        """One step of B sequences: feed ``tokens`` (B,) long (their last sampled speech
        tokens) into ``slots`` (B distinct slots, any lengths). Returns (B, 6564) float32."""
        if tokens.shape != (len(slots),):
            raise ValueError(f"tokens {tuple(tokens.shape)} must be ({len(slots)},): one per slot")
        step = cache.begin(slots, 1, decode=True)
        hidden = self.qwen(self.speech_embedding(tokens)[:, None], step)  # (B, 1, H)
        cache.commit(step)
        return self.speech_log_probs(hidden[:, 0])

    def teacher_forced(self, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole sequences in one causal pass, no cache: ``embeddings`` (B, T, H), each row
        starting at position 0. Returns final hidden states (B, T, H) and speech logits
        (B, T, 6564), both in the model's dtype."""
        hidden: torch.Tensor = self.qwen(embeddings)
        logits: torch.Tensor = self.llm_decoder(hidden)
        return hidden, logits


def _check_ids(ids: torch.Tensor, limit: int, what: str) -> None:
    if ids.dim() != 1 or ids.dtype != torch.long:
        raise InvalidRequestError(f"{what} ids must be a 1-D long tensor, got {tuple(ids.shape)} {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise InvalidRequestError(f"{what} ids must lie in [0, {limit})")


def lm_checkpoint_table(cfg: LMConfig) -> CheckpointTable:
    """Map every key of the official ``llm.pt`` to :class:`CosyVoice2LM`'s state dict.

    ``llm.model.lm_head.weight`` (the unused text head, tied to the text embedding in the
    released model) is an alias of the embedding: written as the same tensor, accepted
    and ignored when reading.
    """
    layer_keys = [f"self_attn.{p}_proj.{t}" for p in "qkv" for t in ("weight", "bias")]
    layer_keys += ["self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
    layer_keys += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    entries = [
        ("llm_embedding.weight", "llm_embedding.weight"),
        (_BACKBONE + "embed_tokens.weight", "qwen.embed_tokens.weight"),
    ]
    for i in range(cfg.qwen.num_hidden_layers):
        entries += [(f"{_BACKBONE}layers.{i}.{key}", f"qwen.layers.{i}.{key}") for key in layer_keys]
    entries += [
        (_BACKBONE + "norm.weight", "qwen.norm.weight"),
        ("speech_embedding.weight", "speech_embedding.weight"),
        ("llm_decoder.weight", "llm_decoder.weight"),
        ("llm_decoder.bias", "llm_decoder.bias"),
    ]
    return CheckpointTable(
        file="llm.pt",
        entries=tuple(entries),
        aliases=(("llm.model.lm_head.weight", _BACKBONE + "embed_tokens.weight"),),
    )
