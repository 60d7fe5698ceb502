"""Flow-matching sampler around the DiT (upstream ``CausalConditionalCFM`` as the CosyVoice 3
flow calls it): Euler steps on a cosine time schedule from CosyVoice's fixed noise, with
classifier-free guidance ``v = (1 + r) v_cond - r v_uncond`` (the unconditional row has
``mu``, ``spks`` and ``cond`` zeroed).

Frame ``i`` always starts from noise column ``i`` (:func:`~cosyserve.models.flow.cfm.fixed_noise`),
so a stream may compute only the frames after those it has cached."""

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from cosyserve.errors import InvalidRequestError
from cosyserve.modeldir.hparams import CFMConfig
from cosyserve.models.dit.cache import FrameCache
from cosyserve.models.dit.dit import DiT
from cosyserve.models.flow.cfm import fixed_noise, time_schedule


class DiTCFM(nn.Module):
    """Integrates the DiT's velocity field from the fixed noise to mel frames."""

    noise: Tensor

    def __init__(self, cfg: CFMConfig, estimator: DiT, channels: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.estimator = estimator
        # Not persistent: flow.pt does not carry it.
        self.register_buffer("noise", fixed_noise(channels), persistent=False)

    def forward(
        self,
        mu: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool,
        caches: Sequence[FrameCache] | None = None,
    ) -> Tensor:
        """``mu``, ``cond``: ``(S, 80, T)``; ``spks``: ``(S, 80)``: one utterance, or the
        chunks of ``S`` streams in lockstep. ``caches`` (streaming): one per Euler step,
        each holding the same frames, which precede these (for several streams, their
        caches stacked: :class:`~cosyserve.models.dit.stacked.StackedStepCache`). Returns
        ``(S, 80, T)`` float32."""
        streams, frames = mu.shape[0], mu.shape[2]
        start = 0 if caches is None else caches[0].length
        if caches is not None and len(caches) != self.cfg.n_timesteps:
            raise ValueError(f"{len(caches)} step caches for {self.cfg.n_timesteps} Euler steps")
        if start + frames > self.noise.shape[2]:
            raise InvalidRequestError(
                f"flow input of {start + frames} mel frames exceeds the maximum of {self.noise.shape[2]}"
            )
        x = self.noise[:, :, start : start + frames].to(mu.dtype).expand(streams, -1, -1)  # (S, 80, T)
        # (2S, ...) stream-major: each stream's conditional row, then its unconditional one.
        mu2, spks2, cond2 = (_with_unconditional(c) for c in (mu, spks, cond))
        rate = self.cfg.inference_cfg_rate
        t_span = time_schedule(self.cfg, mu.device, mu.dtype)
        # Upstream advances t by dt and takes the next dt from that running t: the same
        # recurrence keeps t's float rounding identical.
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, len(t_span)):
            cache = None if caches is None else caches[step - 1]
            rows = x.repeat_interleave(2, dim=0)
            velocity = self.estimator(rows, mu2, cond2, spks2, t.expand(2 * streams), streaming, cache)
            v = velocity.unflatten(0, (streams, 2))  # (S, 2, 80, T)
            x = x + dt * ((1.0 + rate) * v[:, 0] - rate * v[:, 1])
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x.float()


def _with_unconditional(c: Tensor) -> Tensor:
    """``(S, ...)`` -> ``(2S, ...)``: each row followed by zeros (its unconditional row)."""
    return torch.stack([c, torch.zeros_like(c)], dim=1).flatten(0, 1)
