"""Linear layers computed together."""

import torch
from torch import nn

from cosyserve.memory import release_pages


def stacked_linear(*linears: nn.Linear) -> nn.Linear:
    """One Linear computing ``linears`` (same input width) at once: their weight rows (and
    biases, if they have them) stacked, so its output is theirs concatenated."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    biases = [linear.bias for linear in linears]
    stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None, device="meta")
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    if stacked.bias is not None:
        stacked.bias = nn.Parameter(
            torch.cat([b.detach() for b in biases if b is not None]), requires_grad=False
        )
    # The stacked copies replace them: their memory-mapped pages need not stay resident.
    release_pages([linear.weight for linear in linears] + [b for b in biases if b is not None])
    return stacked


def linear_rows(linear: nn.Linear, start: int) -> nn.Linear:
    """A Linear computing ``linear``'s outputs from ``start`` on: its weight rows (and bias)
    from ``start``, as views sharing ``linear``'s memory."""
    width = linear.out_features - start
    rows = nn.Linear(linear.in_features, width, bias=linear.bias is not None, device="meta")
    rows.weight = nn.Parameter(linear.weight.detach()[start:], requires_grad=False)
    if linear.bias is not None:
        rows.bias = nn.Parameter(linear.bias.detach()[start:], requires_grad=False)
    return rows
