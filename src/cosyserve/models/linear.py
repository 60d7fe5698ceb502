"""Linear layers computed together, or on weights held elsewhere."""

import torch
from torch import nn

from cosyserve.memory import release_pages


def linear_on(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A Linear whose parameters are ``weight`` (out, in) and ``bias`` (out,) themselves, not
    copies (frozen): no initial weights are made for it."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return linear


def stacked_linear(*linears: nn.Linear) -> nn.Linear:
    """One Linear computing ``linears`` (same input width) at once: their weight rows (and
    biases, if they have them) stacked, so its output is theirs concatenated."""
    biases = [linear.bias for linear in linears]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
    stacked = linear_on(torch.cat([linear.weight.detach() for linear in linears]), bias)
    # The stacked copies replace them: their memory-mapped pages need not stay resident.
    release_pages([linear.weight for linear in linears] + [b for b in biases if b is not None])
    return stacked


def linear_rows(linear: nn.Linear, start: int) -> nn.Linear:
    """A Linear computing ``linear``'s outputs from ``start`` on: its weight rows (and bias)
    from ``start``, as views sharing ``linear``'s memory."""
    bias = None if linear.bias is None else linear.bias[start:]
    return linear_on(linear.weight[start:], bias)
