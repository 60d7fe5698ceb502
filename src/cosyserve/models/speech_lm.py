"""What the CosyVoice 2 and CosyVoice 3 speech-token language models share.

Both are a Qwen2 body that reads ``[sos] + text embeddings + [task_id] + prompt speech
embeddings`` and then its own speech tokens, with a speech embedding and a linear speech
head of V rows (``cfg.num_speech_ids``). They differ only in where sos and task_id come
from and in the head's size and bias; subclasses build those and say where the two rows
are (:meth:`SpeechLM.sos_and_task_id`). The model holds weights only: each sequence's
state lives in its :class:`~cosyserve.models.kv_cache.KVCache` slot.
"""

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from cosyserve.errors import InvalidRequestError, ModelDirError
from cosyserve.modeldir.hparams import SpeechLMConfig
from cosyserve.models.embedding import embedding
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.qwen2 import Qwen2Model

C = TypeVar("C", bound=SpeechLMConfig)


class SpeechLM(nn.Module, Generic[C]):
    """Qwen2 body + speech embedding (V, H) + speech head H -> V. H = ``cfg.qwen.hidden_size``."""

    def __init__(self, cfg: C, *, head_bias: bool) -> None:
        super().__init__()
        hidden = cfg.qwen.hidden_size
        if not cfg.llm_input_size == cfg.llm_output_size == hidden:
            raise ModelDirError(
                f"llm_input_size ({cfg.llm_input_size}) and llm_output_size ({cfg.llm_output_size}) "
                f"must equal the Qwen2 hidden_size ({hidden})"
            )
        self.cfg = cfg
        self.num_speech_ids = cfg.num_speech_ids
        self.qwen = Qwen2Model(cfg.qwen)
        self.speech_embedding = embedding(self.num_speech_ids, hidden)
        self.llm_decoder = nn.Linear(hidden, self.num_speech_ids, bias=head_bias)

    def sos_and_task_id(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings (1, H) each that open the sequence and separate text from speech."""
        raise NotImplementedError

    def prompt_embeddings(self, text_ids: torch.Tensor, prompt_speech_ids: torch.Tensor) -> torch.Tensor:
        """The prefill input ``[sos] + embed(text_ids) + [task_id] + speech_emb(prompt_speech_ids)``.

        ``text_ids``: (T_text,) long Qwen2 ids, the prompt text followed by the text to
        speak. ``prompt_speech_ids``: (T_p,) long speech tokens < ``speech_token_size``
        (empty without a voice prompt). Returns (T_text + 2 + T_p, H) in the model's dtype.
        """
        check_ids(text_ids, self.cfg.qwen.vocab_size, "text token")
        check_ids(prompt_speech_ids, self.cfg.speech_token_size, "prompt speech token")
        sos, task_id = self.sos_and_task_id()
        return torch.cat(
            [sos, self.qwen.embed_tokens(text_ids), task_id, self.speech_embedding(prompt_speech_ids)]
        )

    def lay_out_head_for_decode_(self) -> None:
        """Store the float32 speech head's weight (V, H) column-major, the same values.

        ``F.linear`` multiplies by the weight's transpose, which is then contiguous: for the
        1-2 rows of a decode step torch's CPU float32 kernel reads it about twice as fast
        as the row-major weight, which takes 5-10 % off a whole decode step of one or two
        rows and costs nothing at batch 8. Other dtypes showed no difference and are left
        as they are."""
        weight = getattr(self.llm_decoder, "weight", None)  # an int8 head has none
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.device.type == "cpu":
            self.llm_decoder.weight = nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=False)

    def speech_log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head on final hidden states (..., H): float32 log-probs (..., V)."""
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
        last position, (V,) float32."""
        step = cache.begin([slot], embeddings.shape[0])
        hidden = self.qwen(embeddings[None], step)  # (1, T, H)
        cache.commit(step)
        return self.speech_log_probs(hidden[0, -1])

    def decode(self, tokens: torch.Tensor, slots: Sequence[int], cache: KVCache) -> torch.Tensor:
        """One step of B sequences: feed ``tokens`` (B,) long (their last sampled speech
        tokens) into ``slots`` (B distinct slots, any lengths). Returns (B, V) float32."""
        if tokens.shape != (len(slots),):
            raise ValueError(f"tokens {tuple(tokens.shape)} must be ({len(slots)},): one per slot")
        step = cache.begin(slots, 1, decode=True)
        hidden = self.qwen(self.speech_embedding(tokens)[:, None], step)  # (B, 1, H)
        cache.commit(step)
        return self.speech_log_probs(hidden[:, 0])

    def teacher_forced(self, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole sequences in one causal pass, no cache: ``embeddings`` (B, T, H), each row
        starting at position 0. Returns final hidden states (B, T, H) and speech logits
        (B, T, V), both in the model's dtype."""
        hidden: torch.Tensor = self.qwen(embeddings)
        logits: torch.Tensor = self.llm_decoder(hidden)
        return hidden, logits


# Either family's LM, where only the shared interface is used (the engine, accel).
AnySpeechLM = SpeechLM[Any]


def check_ids(ids: torch.Tensor, limit: int, what: str) -> None:
    """:class:`InvalidRequestError` unless ``ids`` is a 1-D long tensor of values in [0, limit)."""
    if ids.dim() != 1 or ids.dtype != torch.long:
        raise InvalidRequestError(f"{what} ids must be a 1-D long tensor, got {tuple(ids.shape)} {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise InvalidRequestError(f"{what} ids must lie in [0, {limit})")


def qwen2_layer_keys() -> list[str]:
    """Parameter names of one Qwen2 decoder layer, the same in the official checkpoints and here."""
    keys = [f"self_attn.{p}_proj.{t}" for p in "qkv" for t in ("weight", "bias")]
    keys += ["self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
    return keys + [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
