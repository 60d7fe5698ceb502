"""cosyserve: a production inference server for CosyVoice 2 and Fun-CosyVoice3."""

__version__ = "0.1.0"
