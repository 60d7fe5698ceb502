"""How streaming chunks reach the flow (torch-free, so settings and the CLI can name it);
see :class:`cosyserve.engine.token2wav.Token2Wav`."""

from typing import Literal, get_args

FlowCacheMode = Literal["exact", "cached", "incremental"]
FLOW_CACHE_MODES: tuple[FlowCacheMode, ...] = get_args(FlowCacheMode)


def flow_prompt_whole_problem(whole: bool, mode: FlowCacheMode, prompt_cache_mb: int) -> str | None:
    """Why ``flow_prompt_whole`` cannot act with these settings, or None: it changes how
    the flow prompt cache primes a voice, and there is none without it."""
    if whole and (mode == "exact" or prompt_cache_mb == 0):
        return (
            "flow_prompt_whole needs the flow prompt cache: flow_prompt_cache_mb > 0 and flow_cache not exact"
        )
    return None
