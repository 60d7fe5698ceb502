"""Flow-matching sampler around the DiT (upstream ``CausalConditionalCFM`` as the CosyVoice 3
flow calls it): Euler steps on a cosine time schedule from CosyVoice's fixed noise, with
classifier-free guidance ``v = (1 + r) v_cond - r v_uncond`` (the unconditional row has
``mu``, ``spks`` and ``cond`` zeroed).

Frame ``i`` always starts from noise column ``i`` (:func:`~cosyserve.models.flow.cfm.fixed_noise`),
so a stream may compute only the frames after those it has cached.

The Euler steps come at the same times in every call, so what the DiT's layers take from
the time embedding may be computed once (:meth:`DiTCFM.fix_time_conditioning`): each pass
is then spared the modulation GEMMs, which read six ``D x D`` weights per layer for the two
rows they make, the main cost of a short streamed chunk after its frames' own GEMMs."""

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from cosyserve.errors import InvalidRequestError
from cosyserve.modeldir.hparams import CFMConfig
from cosyserve.models.dit.cache import FrameCache
from cosyserve.models.dit.dit import DiT
from cosyserve.models.dit.modulation import TimeConditioning
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
        # Per Euler step, the estimator's time conditioning (set by fix_time_conditioning).
        self.fixed_conditioning: tuple[TimeConditioning, ...] | None = None

    @torch.no_grad()
    def fix_time_conditioning(self, dtype: torch.dtype) -> None:
        """Compute the estimator's :class:`TimeConditioning` of every Euler step once, for
        inputs of ``dtype`` on the estimator's device, from its weights as they are now:
        later calls in that dtype reuse it (with the same values up to float rounding).
        Call it again after changing the estimator's weights, dtype or device."""
        device = self.noise.device
        times = [t for t, _ in _euler_steps(time_schedule(self.cfg, device, dtype))]
        self.fixed_conditioning = tuple(self.estimator.time_conditioning(t[None]) for t in times)

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
        fixed = self.fixed_conditioning
        if fixed is not None and fixed[0].final[0].dtype != mu.dtype:
            fixed = None
        steps = _euler_steps(time_schedule(self.cfg, mu.device, mu.dtype))
        for step, (t, dt) in enumerate(steps):
            cache = None if caches is None else caches[step]
            time = t.expand(2 * streams) if fixed is None else fixed[step]
            rows = x.repeat_interleave(2, dim=0)
            velocity = self.estimator(rows, mu2, cond2, spks2, time, streaming, cache)
            v = velocity.unflatten(0, (streams, 2))  # (S, 2, 80, T)
            x = x + dt * ((1.0 + rate) * v[:, 0] - rate * v[:, 1])
        return x.float()


def _euler_steps(t_span: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Each Euler step's time and step size (0-d tensors). Upstream advances t by dt and
    takes the next dt from that running t: the same recurrence keeps t's float rounding
    identical."""
    steps = []
    t, dt = t_span[0], t_span[1] - t_span[0]
    for step in range(1, len(t_span)):
        steps.append((t, dt))
        t = t + dt
        if step < len(t_span) - 1:
            dt = t_span[step + 1] - t
    return steps


def _with_unconditional(c: Tensor) -> Tensor:
    """``(S, ...)`` -> ``(2S, ...)``: each row followed by zeros (its unconditional row)."""
    return torch.stack([c, torch.zeros_like(c)], dim=1).flatten(0, 1)
