"""Deterministic random initialisation for generated (not downloaded) model directories."""

import math

import torch
from torch import nn


@torch.no_grad()
def randomize_(module: nn.Module, generator: torch.Generator) -> None:
    """Fill every parameter of ``module`` from ``generator``, in name order.

    Matrices and kernels get N(0, 1/fan_in) so activations keep unit scale through deep
    stacks (random weights must still give finite, non-trivial outputs for parity tests);
    1-D ``weight`` vectors (norm gains, per-channel scales) get 1 + N(0, 0.05²) and other
    vectors (biases) N(0, 0.05²).
    """
    for name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if param.dim() >= 2:
            fan_in = param[0].numel()
            value = noise / math.sqrt(fan_in)
        elif name.endswith("weight"):
            value = 1.0 + 0.05 * noise
        else:
            value = 0.05 * noise
        param.copy_(value.to(param.dtype))
