"""The CosyVoice 3 flow (upstream ``CausalMaskedDiffWithDiT``): speech tokens, a voice
prompt and a speaker embedding -> 80-bin log-mel frames at 50 Hz.

Tokens are embedded, mixed with their neighbours by the pre-look-ahead convolutions,
repeated ``token_mel_ratio`` times, and condition the DiT flow-matching sampler directly
(no conformer encoder as in CosyVoice 2)."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.errors import ModelDirError
from cosyserve.modeldir.hparams3 import Flow3Config
from cosyserve.models.dit.cfm import DiTCFM
from cosyserve.models.dit.dit import DiT
from cosyserve.models.dit.table import flow3_checkpoint_table
from cosyserve.models.embedding import embedding
from cosyserve.models.flow.encoder import PreLookahead

__all__ = ["Flow3", "check_flow3_config", "flow3_checkpoint_table"]


def check_flow3_config(cfg: Flow3Config) -> None:
    """Raise :class:`ModelDirError` for a geometry this implementation (or upstream) cannot run."""
    dit, problems = cfg.dit, []
    if cfg.input_size != dit.mu_dim:
        problems.append(f"token width {cfg.input_size} != DiT mu_dim {dit.mu_dim}")
    if not cfg.output_size == dit.mel_dim == dit.spk_dim == cfg.cfm.spk_emb_dim:
        sizes = f"{cfg.output_size}/{dit.mel_dim}/{dit.spk_dim}/{cfg.cfm.spk_emb_dim}"
        problems.append(f"mel and speaker widths {sizes} differ")
    if cfg.cfm.t_scheduler not in ("cosine", "linear"):
        problems.append(f"t_scheduler {cfg.cfm.t_scheduler!r}")
    if cfg.pre_lookahead_len < 1:
        problems.append(f"pre_lookahead_len {cfg.pre_lookahead_len}")
    if problems:
        raise ModelDirError("unsupported flow configuration: " + "; ".join(problems))


class Flow3(nn.Module):
    """Token-to-mel model. Load weights with :func:`flow3_checkpoint_table` (``flow.pt``)."""

    def __init__(self, cfg: Flow3Config) -> None:
        super().__init__()
        check_flow3_config(cfg)
        self.cfg = cfg
        self.token_embedding = embedding(cfg.vocab_size, cfg.input_size)
        self.speaker_proj = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.lookahead = PreLookahead(cfg.input_size, cfg.pre_lookahead_len, cfg.pre_lookahead_channels)
        self.cfm = DiTCFM(cfg.cfm, DiT(cfg.dit), cfg.output_size)

    def speaker(self, embedding: Tensor) -> Tensor:
        """Speaker embedding ``(1, spk_embed_dim)`` -> ``(1, 80)``: L2-normalised, projected."""
        out: Tensor = self.speaker_proj(F.normalize(embedding, dim=1))
        return out

    def token_features(self, tokens: Tensor, context: Tensor | None) -> Tensor:
        """``tokens`` ``(1, N)`` (prompt first) -> ``mu`` ``(1, 80, N * token_mel_ratio)``.

        ``context``: ``(1, pre_lookahead_len)`` tokens after ``tokens`` that the last ones
        look ahead to (while streaming), or None for zeros (the utterance is finished)."""
        x = self.token_embedding(tokens.clamp(min=0))  # (1, N, 80)
        ctx = None if context is None else self.token_embedding(context.clamp(min=0))
        lengths = torch.full((tokens.shape[0],), tokens.shape[1], device=tokens.device)
        h: Tensor = self.lookahead(x, lengths, ctx)  # (1, N, 80)
        return h.repeat_interleave(self.cfg.token_mel_ratio, dim=1).transpose(1, 2)

    @staticmethod
    def conditions(prompt_feat: Tensor, frames: int) -> Tensor:
        """Prompt mel ``(1, F, 80)`` -> ``(1, 80, frames)``: the prompt in the first ``F``
        frames, zeros after."""
        cond = prompt_feat.new_zeros(prompt_feat.shape[0], frames, prompt_feat.shape[2])
        cond[:, : prompt_feat.shape[1]] = prompt_feat
        return cond.transpose(1, 2)

    @torch.inference_mode()
    def inference(
        self,
        token: Tensor,
        prompt_token: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        streaming: bool,
        finalize: bool,
    ) -> Tensor:
        """Upstream's ``CausalMaskedDiffWithDiT.inference`` (batch of one).

        ``token``: ``(1, N)`` generated tokens, ending, unless ``finalize``, with
        ``pre_lookahead_len`` look-ahead tokens that get no frames; ``prompt_token``:
        ``(1, P)``; ``prompt_feat``: ``(1, F, 80)`` prompt mel (``F = 2P`` normally);
        ``embedding``: ``(1, spk_embed_dim)``; ``streaming``: chunk-causal attention.
        Returns the mel after the prompt's ``F`` frames, ``(1, 80, T)`` float32."""
        tokens = torch.cat([prompt_token, token], dim=1)
        context = None
        if not finalize:
            split = tokens.shape[1] - self.cfg.pre_lookahead_len
            tokens, context = tokens[:, :split], tokens[:, split:]
        mu = self.token_features(tokens, context)
        frames = mu.shape[2]
        cond = self.conditions(prompt_feat.to(mu.dtype), frames)
        mel: Tensor = self.cfm(mu, self.speaker(embedding.to(mu.dtype)), cond, streaming)
        return mel[:, :, prompt_feat.shape[1] :]
