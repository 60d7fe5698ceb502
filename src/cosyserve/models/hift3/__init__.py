"""The CosyVoice 3 vocoder (causal HiFT: mel -> 24 kHz waveform), its checkpoint table and
its stateful stream."""

from cosyserve.models.hift3.generator import CausalHiFTGenerator, causal_hift_checkpoint_table
from cosyserve.models.hift3.source import noise_window
from cosyserve.models.hift3.stream import CausalHiFTStream

__all__ = ["CausalHiFTGenerator", "CausalHiFTStream", "causal_hift_checkpoint_table", "noise_window"]
