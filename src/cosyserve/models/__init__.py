"""Native PyTorch implementations of the CosyVoice 2 networks (LM, flow, HiFT)."""
