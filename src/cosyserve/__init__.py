"""cosyserve: a production inference server for CosyVoice 2."""

__version__ = "0.1.0"
