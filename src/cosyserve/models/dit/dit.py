"""The DiT velocity estimator of the CosyVoice 3 flow (upstream
``cosyvoice.flow.DiT.dit.DiT``): input embedding, ``depth`` time-modulated transformer
layers with rotary position, final modulated norm and projection to mel channels.

Streaming makes attention chunk-causal: frame ``i`` sees frames before the end of its
``static_chunk_size`` chunk, chunks counted from the first frame (the prompt's), and
every earlier chunk: upstream's forward passes -1 left chunks whatever
``num_decoding_left_chunks`` says, so that field is not used."""

import itertools
from typing import cast

from torch import Tensor, nn

from cosyserve.errors import ModelDirError
from cosyserve.modeldir.hparams3 import DiTConfig
from cosyserve.models.dit.block import DiTBlock
from cosyserve.models.dit.cache import FrameCache
from cosyserve.models.dit.embed import POS_GROUPS, InputEmbedding, TimeEmbedding
from cosyserve.models.dit.modulation import FinalModulation, TimeConditioning, modulate
from cosyserve.models.dit.rotary import Rotary
from cosyserve.models.flow.masks import chunk_mask


def check_dit_config(cfg: DiTConfig) -> None:
    """Raise :class:`ModelDirError` for a geometry this implementation cannot run."""
    problems = []
    if cfg.long_skip_connection:
        problems.append("long_skip_connection (unused by the released model)")
    if cfg.dim % POS_GROUPS:
        problems.append(f"dim {cfg.dim} not a multiple of the positional convolution's {POS_GROUPS} groups")
    if cfg.dim_head % 2:
        problems.append(f"odd dim_head {cfg.dim_head}")
    if cfg.out_channels != cfg.mel_dim:
        problems.append(f"out_channels {cfg.out_channels} != mel_dim {cfg.mel_dim}")
    if cfg.static_chunk_size < 1:
        problems.append(f"static_chunk_size {cfg.static_chunk_size} (must be at least 1)")
    if problems:
        raise ModelDirError("unsupported DiT configuration: " + "; ".join(problems))


class DiT(nn.Module):
    """Velocity field ``v(x, t | mu, cond, spks)`` over mel frames."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        check_dit_config(cfg)
        self.cfg = cfg
        # nn.Module: release_time_layers puts placeholders here.
        self.time_embed: nn.Module = TimeEmbedding(cfg.dim)
        self.input_embed = InputEmbedding(cfg.mel_dim, cfg.mu_dim, cfg.spk_dim, cfg.dim)
        self.rotary = Rotary(cfg.dim_head)
        self.blocks = nn.ModuleList(
            DiTBlock(cfg.dim, cfg.heads, cfg.dim_head, cfg.ff_mult, layer) for layer in range(cfg.depth)
        )
        self._blocks = cast(list[DiTBlock], list(self.blocks))  # the same modules, typed
        self.norm_out: nn.Module = FinalModulation(cfg.dim)
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)

    def time_conditioning(self, t: Tensor) -> TimeConditioning:
        """``t`` ``(B,)`` -> what the layers take from its embedding, ``(B, D)`` each."""
        time = self.time_embed(t)  # (B, D)
        return TimeConditioning(tuple(block.modulation(time) for block in self._blocks), self.norm_out(time))

    def release_time_layers(self) -> list[Tensor]:
        """Replace the layers that only make the time conditioning (the time embedding,
        every layer's modulation and the final one's) by placeholders that refuse to run,
        once the sampler keeps this DiT's conditioning fixed
        (:meth:`~cosyserve.models.dit.cfm.DiTCFM.fix_time_conditioning`). Returns their
        tensors, whose memory the caller may release: the modulations are 6 D² weights
        of a layer's 14 D²."""
        time_layers = [self.time_embed, self.norm_out, *(b.modulation for b in self._blocks)]
        tensors = [t for m in time_layers for t in itertools.chain(m.parameters(), m.buffers())]
        self.time_embed, self.norm_out = _Released(), _Released()
        for block in self._blocks:
            block.modulation = _Released()
        return tensors

    def forward(
        self,
        x: Tensor,
        mu: Tensor,
        cond: Tensor,
        spks: Tensor,
        t: Tensor | TimeConditioning,
        streaming: bool,
        cache: FrameCache | None = None,
    ) -> Tensor:
        """``x``, ``mu``, ``cond``: ``(B, 80, T)``; ``spks``: ``(B, 80)``; ``t``: ``(B,)``, or
        its :meth:`time_conditioning` computed before (the sampler's steps come at the same
        times in every call). ``cache`` (streaming only): the frames before these, whose
        keys/values the new frames attend to; the new frames' become pending in it.
        Returns ``(B, 80, T)``."""
        frames = x.shape[2]
        start = 0 if cache is None else cache.length
        if cache is not None and not streaming:
            raise ValueError("cached frames need chunk-causal (streaming) attention")
        conditioning = t if isinstance(t, TimeConditioning) else self.time_conditioning(t)
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks, cache)
        angles = self.rotary.angles(start, frames)  # (T, d)
        mask = chunk_mask(start + frames, self.cfg.static_chunk_size, x.device, start) if streaming else None
        for block, modulation in zip(self.blocks, conditioning.blocks, strict=True):
            h = block(h, modulation, angles, mask, cache)
        scale, shift = conditioning.final
        out: Tensor = self.proj_out(modulate(h, shift, scale))
        return out.transpose(1, 2)


class _Released(nn.Module):
    """Where a time layer was (:meth:`DiT.release_time_layers`)."""

    def forward(self, time: Tensor) -> Tensor:
        raise RuntimeError(
            "the DiT's time layers were released: it runs with its sampler's fixed time conditioning only"
        )
