"""The CosyVoice 3 flow: a DiT flow-matching decoder conditioned on speech tokens."""

from cosyserve.models.dit.flow3 import Flow3, check_flow3_config, flow3_checkpoint_table
from cosyserve.models.dit.prompt_cache import Flow3PromptCache
from cosyserve.models.dit.stream import (
    Flow3Stream,
    prime_prompt,
    primed_prompt_frames,
    push_streams,
    stream_cache_bytes,
)

__all__ = [
    "Flow3",
    "Flow3PromptCache",
    "Flow3Stream",
    "check_flow3_config",
    "flow3_checkpoint_table",
    "prime_prompt",
    "primed_prompt_frames",
    "push_streams",
    "stream_cache_bytes",
]
