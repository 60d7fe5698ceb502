"""The flow's token encoder (upstream ``UpsampleConformerEncoder``): 25 Hz token
embeddings -> conformer -> x2 upsampling -> conformer -> 50 Hz hidden states.

Behaviour follows upstream ``cosyvoice/transformer/upsample_encoder.py`` with the
released configuration (linear input layer, ``rel_pos_espnet``, pre-norm, no CNN module).
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyserve.modeldir.hparams import EncoderConfig
from cosyserve.models.flow.blocks import causal_conv, conv1d
from cosyserve.models.flow.conformer import ConformerLayer, rel_position_embedding
from cosyserve.models.flow.masks import attention_mask, padding_mask
from cosyserve.models.flow.stream_cache import FlowStreamCache, LayerStates


class LinearEmbed(nn.Module):
    """``Linear -> LayerNorm``, scaled by ``√D`` as ESPnet's relative-position encoding
    does before the conformer layers (dropout is a no-op at inference)."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_dim, dim)
        self.norm = nn.LayerNorm(dim, eps=1e-5)
        self.scale = math.sqrt(dim)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, T, D_in)`` -> ``(B, T, D)``."""
        y: Tensor = self.norm(self.linear(x))
        return y * self.scale


class PreLookahead(nn.Module):
    """Mixes each position with the next ``lookahead`` positions (``conv1``), then with
    the two previous ones (``conv2``), plus a residual.

    At the end of each row the look-ahead sees ``context`` (real future tokens, while
    streaming) or zeros (when the utterance is finished). ``hidden``: the width between
    the two convolutions (CosyVoice 3 widens it), ``dim`` when None."""

    def __init__(self, dim: int, lookahead: int, hidden: int | None = None) -> None:
        super().__init__()
        width = dim if hidden is None else hidden
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(dim, width, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(width, dim, kernel_size=3)

    def forward(
        self, x: Tensor, lengths: Tensor, context: Tensor | None, states: LayerStates | None = None
    ) -> Tensor:
        """``x``: ``(B, T, D)``, zero after each row's ``lengths`` ``(B,)``; ``context``:
        ``(B, C, D)`` with ``C <= lookahead``, placed right after row ``b``'s
        ``lengths[b]`` positions, or None. ``states``: cached positions before ``x``
        (incremental streaming). Returns ``(B, T, D)``."""
        h = x.transpose(1, 2)  # (B, D, T)
        if context is not None:
            width = context.shape[1]
            if width > self.lookahead:
                raise ValueError(f"look-ahead context of {width} > {self.lookahead} positions")
            # Right after each row's own end, so a short row of a ragged batch sees its
            # context where it would alone (over zero padding, which it would not see).
            index = lengths.unsqueeze(1) + torch.arange(width, device=h.device)  # (B, C)
            h = F.pad(h, (0, width)).scatter(
                2, index.unsqueeze(1).expand(-1, h.shape[1], -1), context.transpose(1, 2)
            )
        h = F.pad(h, (0, self.lookahead + x.shape[1] - h.shape[2]))  # (B, D, T + lookahead)
        h = F.leaky_relu(conv1d(self.conv1, h), negative_slope=0.01)  # (B, D, T)
        return causal_conv(self.conv2, h, states).transpose(1, 2) + x


class Upsample(nn.Module):
    """Nearest-neighbour x``stride`` repetition, then a causal convolution (left pad
    ``2*stride``, kernel ``2*stride+1``), so no output frame looks ahead."""

    def __init__(self, dim: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(dim, dim, kernel_size=2 * stride + 1)

    def forward(self, x: Tensor, states: LayerStates | None = None) -> Tensor:
        """``(B, D, T)`` -> ``(B, D, stride*T)``; ``states``: cached output frames before
        these (incremental streaming)."""
        h = x.repeat_interleave(self.stride, dim=2)
        return causal_conv(self.conv, h, states)


class UpsampleConformerEncoder(nn.Module):
    """Token embeddings ``(B, T, D_in)`` at 25 Hz -> hidden states ``(B, 2T, D)`` at 50 Hz.

    Streaming uses block-causal attention with chunks of ``static_chunk_size`` tokens
    (``static_chunk_size * stride`` frames after upsampling), counted from position 0.
    """

    def __init__(self, cfg: EncoderConfig, pre_lookahead_len: int) -> None:
        super().__init__()
        dim = cfg.output_size
        self.chunk_size = cfg.static_chunk_size
        self.stride = cfg.upsample_stride
        self.embed = LinearEmbed(cfg.input_size, dim)
        self.lookahead = PreLookahead(dim, pre_lookahead_len)
        self.layers = nn.ModuleList(
            ConformerLayer(dim, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.num_blocks)
        )
        self.upsample = Upsample(dim, cfg.upsample_stride)
        self.up_embed = LinearEmbed(cfg.input_size, dim)
        self.up_layers = nn.ModuleList(
            ConformerLayer(dim, cfg.attention_heads, cfg.linear_units) for _ in range(cfg.num_up_blocks)
        )
        self.final_norm = nn.LayerNorm(dim, eps=1e-5)

    @property
    def output_size(self) -> int:
        return self.final_norm.normalized_shape[0]

    def forward(
        self,
        x: Tensor,
        lengths: Tensor,
        context: Tensor | None = None,
        streaming: bool = False,
        cache: FlowStreamCache | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Encode token embeddings.

        ``x``: ``(B, T, D_in)`` (rows padded after ``lengths``); ``lengths``: ``(B,)`` int64;
        ``context``: ``(B, C, D_in)`` embeddings of up to ``pre_lookahead_len`` future tokens
        that the look-ahead convolution sees after row ``b``'s last position
        ``lengths[b] - 1`` (not encoded themselves), or None for zeros. Returns
        ``(B, stride*T, D)`` and the output lengths ``(B,)``.

        ``cache`` (streaming only): ``x`` holds the tokens after the
        ``cache.encoder_tokens.length`` cached ones, and the output the frames after
        ``cache.encoder_frames.length``; positions are counted from the cached start.
        """
        if cache is not None and not streaming:
            raise ValueError("the incremental encoder needs block-causal (streaming) attention")
        token_states = None if cache is None else cache.encoder_tokens
        frame_states = None if cache is None else cache.encoder_frames
        valid = padding_mask(lengths, x.shape[1])  # (B, T)
        # Zeroed padding looks like the zero right-padding a lone request gets, so each
        # row of a ragged batch encodes as it would alone.
        h = self.embed(x) * valid.unsqueeze(-1).to(x.dtype)
        h = self.lookahead(h, lengths, None if context is None else self.embed(context), token_states)
        h = self._layers(self.layers, h, valid, self.chunk_size if streaming else 0, token_states)

        h = self.upsample(h.transpose(1, 2), frame_states).transpose(1, 2)  # (B, stride*T, D)
        lengths = lengths * self.stride
        valid = padding_mask(lengths, h.shape[1])
        h = self.up_embed(h)
        chunk = self.chunk_size * self.stride if streaming else 0
        h = self._layers(self.up_layers, h, valid, chunk, frame_states)
        return self.final_norm(h), lengths

    @staticmethod
    def _layers(
        layers: nn.ModuleList, h: Tensor, valid: Tensor, chunk_size: int, states: LayerStates | None
    ) -> Tensor:
        start = 0 if states is None else states.length
        size = h.shape[1]
        mask = attention_mask(valid, chunk_size, start)  # (B, T, start + T)
        pos_emb = rel_position_embedding(start + size, h.shape[2], h.device, h.dtype, size)
        for layer in layers:
            h = layer(h, mask, pos_emb, states)
        return h
