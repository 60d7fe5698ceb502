"""Embedding tables, left uninitialised where they are built on the meta device."""

import torch
from torch import nn


def embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)``. Built on the meta device (the loader's skeleton, whose
    weights the checkpoint then replaces), its table gets no initial values: torch has no
    C++ meta kernel for the ``normal_`` that makes them, and its Python one imports
    ``torch._dynamo`` the first time (2.3 s of a server's start on 2 cores) for values
    nothing reads."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)
