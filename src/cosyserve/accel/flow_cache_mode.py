"""How streaming chunks reach the flow (torch-free, so settings and the CLI can name it);
see :class:`cosyserve.engine.token2wav.Token2Wav`."""

from typing import Literal, get_args

FlowCacheMode = Literal["exact", "cached", "incremental"]
FLOW_CACHE_MODES: tuple[FlowCacheMode, ...] = get_args(FlowCacheMode)


def default_flow_cache(device: str) -> FlowCacheMode:
    """The streaming flow mode for a model on ``device`` (``cpu``, ``cuda[:N]``) when none is
    set. On a CPU a chunk costs its arithmetic, so ``incremental`` computes the least. On
    CUDA a chunk of any width costs about the same (tens of thousands of small kernel
    launches), and incremental chunks batch only with streams at the same position, so
    ``exact``, whose chunks all go in one batch, serves more streams: on an H200, 16
    streams made 6.47 audio-s/s against 3.17 and held 2.6 GiB of GPU memory against 15
    (``docs/benchmarks.md``, "On a GPU")."""
    return "exact" if device.split(":")[0] == "cuda" else "incremental"


def flow_prompt_whole_problem(whole: bool, mode: FlowCacheMode, prompt_cache_mb: int) -> str | None:
    """Why ``flow_prompt_whole`` cannot act with these settings, or None: it changes how
    the flow prompt cache primes a voice, and there is none without it."""
    if whole and (mode == "exact" or prompt_cache_mb == 0):
        return (
            "flow_prompt_whole needs the flow prompt cache: flow_prompt_cache_mb > 0 and flow_cache not exact"
        )
    return None
