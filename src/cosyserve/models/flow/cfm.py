"""Conditional flow matching sampler (upstream ``CausalConditionalCFM``): Euler steps
on a cosine time schedule with classifier-free guidance and fixed noise.

The noise is upstream's ``torch.manual_seed(0); torch.randn(1, 80, 15000)``, drawn from a
private generator so the global RNG is untouched. Frame ``i`` always gets noise column
``i``: re-running the flow over a growing prefix (streaming) reproduces the frames it
emitted before.
"""

import math
from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor, nn

from cosyserve.errors import InvalidRequestError
from cosyserve.modeldir.hparams import CFMConfig
from cosyserve.models.flow.estimator import Estimator
from cosyserve.models.flow.step_graph import StepCapture, StepGraph
from cosyserve.models.flow.stream_cache import LayerStates
from cosyserve.models.flow.traced_steps import TracedSteps

# 300 s at 50 frames/s, prompt included: upstream's noise length, hence the longest output.
MAX_FRAMES = 50 * 300
NOISE_SEED = 0


def fixed_noise(channels: int) -> Tensor:
    """``(1, channels, MAX_FRAMES)`` float32, equal to upstream's
    ``torch.manual_seed(0); torch.randn(1, channels, 15000)`` on CPU."""
    generator = torch.Generator(device="cpu").manual_seed(NOISE_SEED)
    return torch.randn(1, channels, MAX_FRAMES, generator=generator, device="cpu")


def time_schedule(cfg: CFMConfig, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``(n_timesteps + 1,)`` from 0 to 1; the cosine schedule ``1 - cos(t π/2)`` spends
    more steps near the noise end. Both families' samplers use it."""
    t = torch.linspace(0, 1, cfg.n_timesteps + 1, device=device, dtype=dtype)
    if cfg.t_scheduler == "cosine":
        t = 1 - torch.cos(t * 0.5 * math.pi)
    return t


class CFM(nn.Module):
    """Integrates the estimator's velocity field from the fixed noise to mel frames."""

    noise: Tensor

    def __init__(self, cfg: CFMConfig, estimator: Estimator, channels: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.estimator = estimator
        # Replays the estimator's calls (set by Flow.trace_steps_).
        self.traced_steps: TracedSteps | None = None
        # Replays the later Euler steps of calls without cached state (set on a GPU by the
        # engine: cosyserve.models.flow.step_graph).
        self.step_capture: StepCapture | None = None
        # Not persistent: flow.pt does not carry it; it moves with .to(device/dtype).
        self.register_buffer("noise", fixed_noise(channels), persistent=False)

    def forward(
        self,
        mu: Tensor,
        mask: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool,
        states: Sequence[LayerStates] | None = None,
    ) -> Tensor:
        """Sample mel frames.

        ``mu``: ``(B, 80, T)`` encoder output; ``mask``: ``(B, 1, T)`` float (1 = valid frame);
        ``spks``: ``(B, 80)`` projected speaker embedding; ``cond``: ``(B, 80, T)`` prompt mel
        in its frames, zeros elsewhere. ``streaming`` selects block-causal attention.
        Returns ``(B, 80, T)`` float32.

        ``states`` (incremental streaming): one per Euler step, each holding the same
        ``length`` cached frames; the inputs are the frames after those, and draw the noise
        of their absolute positions.

        Classifier-free guidance runs the conditional and unconditional (mu, spks, cond
        zeroed) halves as one batch of ``2B``: ``v = (1 + r) v_cond - r v_uncond``.
        """
        batch, _, frames = mu.shape
        start = 0 if states is None else states[0].length
        if states is not None and len(states) != self.cfg.n_timesteps:
            raise ValueError(f"{len(states)} step states for {self.cfg.n_timesteps} Euler steps")
        if start + frames > self.noise.shape[2]:
            raise InvalidRequestError(
                f"flow input of {start + frames} mel frames exceeds the maximum of "
                f"{self.noise.shape[2]} (300 s)"
            )
        x = self.noise[:, :, start : start + frames].to(mu.dtype).expand(batch, -1, -1)  # (B, 80, T)
        mask2 = torch.cat([mask, mask])  # (2B, 1, T)
        mu2 = torch.cat([mu, torch.zeros_like(mu)])
        spks2 = torch.cat([spks, torch.zeros_like(spks)])
        cond2 = torch.cat([cond, torch.zeros_like(cond)])
        bias = self.estimator.attention_bias(mask2, streaming, start)
        rate = self.cfg.inference_cfg_rate

        t_span = time_schedule(self.cfg, mu.device, mu.dtype)
        # Upstream advances t by dt and takes the next dt relative to that running t;
        # the same recurrence keeps the float rounding of t identical.
        t, dt = t_span[0], t_span[1] - t_span[0]
        graph: StepGraph | None = None
        for step in range(1, len(t_span)):
            x2, t2 = torch.cat([x, x]), t.expand(2 * batch)
            step_states = None if states is None else states[step - 1]
            if graph is not None:
                velocity = graph(x2, t2)
            elif self.traced_steps is not None:
                velocity = self.traced_steps((x2, mask2, mu2, t2, spks2, cond2), bias, step_states)
            else:
                velocity = self.estimator(x2, mask2, mu2, t2, spks2, cond2, bias, step_states)
                if self.step_capture is not None and states is None and step < len(t_span) - 1:
                    run = partial(self._velocity, mask=mask2, mu=mu2, spks=spks2, cond=cond2, bias=bias)
                    graph = StepGraph(run, x2, t2, self.step_capture)
            v_cond, v_uncond = velocity[:batch], velocity[batch:]
            x = x + dt * ((1.0 + rate) * v_cond - rate * v_uncond)
            t = t + dt
            if step < len(t_span) - 1:
                dt = t_span[step + 1] - t
        return x.float()

    def _velocity(
        self, x: Tensor, t: Tensor, mask: Tensor, mu: Tensor, spks: Tensor, cond: Tensor, bias: Tensor | None
    ) -> Tensor:
        """The estimator without cached state, ``x`` and ``t`` first (:class:`StepGraph`)."""
        velocity: Tensor = self.estimator(x, mask, mu, t, spks, cond, bias)
        return velocity
