"""How streaming chunks reach the flow (torch-free, so settings and the CLI can name it);
see :class:`cosyserve.engine.token2wav.Token2Wav`."""

from typing import Literal, get_args

FlowCacheMode = Literal["exact", "cached", "incremental"]
# MiB of voices' primed flow prompt states kept: a 3 s prompt primes about 440 MiB in fp32
# on the full model (220 MiB in bf16/fp16), so 8 such voices in fp32.
DEFAULT_FLOW_PROMPT_CACHE_MB = 4096
FLOW_CACHE_MODES: tuple[FlowCacheMode, ...] = get_args(FlowCacheMode)
# What streams' incremental flow caches hold their positions in: as the flow computes,
# float16 (a float32 flow's; 16-bit flows hold theirs so anyway) or int8 rows with a scale
# each (a stream's own positions; a voice's primed ones stay float16 or as computed).
FlowCacheDtype = Literal["computed", "fp16", "int8"]
FLOW_CACHE_DTYPES: tuple[FlowCacheDtype, ...] = get_args(FlowCacheDtype)


def flow_prompt_whole_problem(whole: bool, mode: FlowCacheMode, prompt_cache_mb: int) -> str | None:
    """Why ``flow_prompt_whole`` cannot act with these settings, or None: it changes how
    the flow prompt cache primes a voice, and there is none without it."""
    if whole and (mode == "exact" or prompt_cache_mb == 0):
        return (
            "flow_prompt_whole needs the flow prompt cache: flow_prompt_cache_mb > 0 and flow_cache not exact"
        )
    return None
