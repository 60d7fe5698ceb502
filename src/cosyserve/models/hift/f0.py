"""The F0 predictor: log-mel frames to a non-negative pitch contour (upstream's ConvRNNF0Predictor)."""

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Upstream hard-codes five conv layers; the checkpoint layout depends on it.
NUM_CONV_LAYERS = 5


class F0Predictor(nn.Module):
    """Five (Conv1d k3 + ELU) layers, a per-frame Linear to one value, and ``abs``."""

    def __init__(self, in_channels: int, channels: int) -> None:
        super().__init__()
        widths = [in_channels] + [channels] * NUM_CONV_LAYERS
        self.convs = nn.ModuleList(
            nn.Conv1d(c_in, c_out, kernel_size=3, padding=1) for c_in, c_out in itertools.pairwise(widths)
        )
        self.classifier = nn.Linear(channels, 1)

    def forward(self, mel: Tensor) -> Tensor:
        """``mel``: (B, n_mels, T) -> f0 in Hz: (B, T), >= 0."""
        x = mel
        for conv in self.convs:
            x = F.elu(conv(x))
        f0: Tensor = self.classifier(x.transpose(1, 2)).squeeze(-1)  # (B, T, C) -> (B, T)
        return torch.abs(f0)
