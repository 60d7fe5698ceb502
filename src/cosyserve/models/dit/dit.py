"""The DiT velocity estimator of the CosyVoice 3 flow (upstream
``cosyvoice.flow.DiT.dit.DiT``): input embedding, ``depth`` time-modulated transformer
layers with rotary position, final modulated norm and projection to mel channels.

Streaming makes attention chunk-causal: frame ``i`` sees frames before the end of its
``static_chunk_size`` chunk, chunks counted from the first frame (the prompt's), and
every earlier chunk: upstream's forward passes -1 left chunks whatever
``num_decoding_left_chunks`` says, so that field is not used."""

from torch import Tensor, nn

from cosyserve.errors import ModelDirError
from cosyserve.modeldir.hparams3 import DiTConfig
from cosyserve.models.dit.block import DiTBlock
from cosyserve.models.dit.cache import FrameCache
from cosyserve.models.dit.embed import POS_GROUPS, InputEmbedding, TimeEmbedding
from cosyserve.models.dit.modulation import FinalModulation
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
        self.time_embed = TimeEmbedding(cfg.dim)
        self.input_embed = InputEmbedding(cfg.mel_dim, cfg.mu_dim, cfg.spk_dim, cfg.dim)
        self.rotary = Rotary(cfg.dim_head)
        self.blocks = nn.ModuleList(
            DiTBlock(cfg.dim, cfg.heads, cfg.dim_head, cfg.ff_mult, layer) for layer in range(cfg.depth)
        )
        self.norm_out = FinalModulation(cfg.dim)
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)

    def forward(
        self,
        x: Tensor,
        mu: Tensor,
        cond: Tensor,
        spks: Tensor,
        t: Tensor,
        streaming: bool,
        cache: FrameCache | None = None,
    ) -> Tensor:
        """``x``, ``mu``, ``cond``: ``(B, 80, T)``; ``spks``: ``(B, 80)``; ``t``: ``(B,)``.
        ``cache`` (streaming only): the frames before these, whose keys/values the new
        frames attend to; the new frames' become pending in it. Returns ``(B, 80, T)``."""
        frames = x.shape[2]
        start = 0 if cache is None else cache.length
        if cache is not None and not streaming:
            raise ValueError("cached frames need chunk-causal (streaming) attention")
        time = self.time_embed(t)  # (B, D)
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks, cache)
        angles = self.rotary.angles(start, frames)  # (T, d)
        mask = chunk_mask(start + frames, self.cfg.static_chunk_size, x.device, start) if streaming else None
        for block in self.blocks:
            h = block(h, time, angles, mask, cache)
        out: Tensor = self.proj_out(self.norm_out(h, time))
        return out.transpose(1, 2)
