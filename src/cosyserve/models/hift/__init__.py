"""The HiFT vocoder (mel -> 24 kHz waveform), its checkpoint table and streaming state."""

from cosyserve.models.hift.generator import HiFTGenerator, hift_checkpoint_table
from cosyserve.models.hift.source import Excitation
from cosyserve.models.hift.stream import HiFTStreamState, StreamOptions, vocode_chunk

__all__ = [
    "Excitation",
    "HiFTGenerator",
    "HiFTStreamState",
    "StreamOptions",
    "hift_checkpoint_table",
    "vocode_chunk",
]
