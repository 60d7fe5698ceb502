"""Optional ``torch.compile`` of the LM's MLPs, warmed up at load.

Inductor, dynamic shapes, weight freezing (without freezing the compiled CPU model is
slower than eager). Only each decoder layer's MLP is compiled: it holds 88 % of the
layer's weights, takes one tensor, and its 24 instances share three graphs (prefill,
decode at batch 1, decode at batch > 1). The attention stays eager: its KV-cache step
carries Python tuples of slots, on which dynamo guards, so every new decode batch size
would compile again (and past torch's recompile limit run eager).

Graphs compile on first use of each shape family, so :func:`compile_lm_` runs one of
each at once and the first requests find them ready. Off by default: on a CPU it gains
nothing and adds to the start (``docs/precision.md``, "How each choice works").
"""

import logging
import time

import torch

from cosyserve.accel.precision import Precision
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.qwen2 import MLP
from cosyserve.models.speech_lm import AnySpeechLM

logger = logging.getLogger(__name__)

_WARM_UP_PREFILL = 4  # positions of the warm-up prefill (any length > 1 is the same graph)


def compile_lm_(lm: AnySpeechLM, precision: Precision) -> float:
    """Compile ``lm``'s MLPs in place and warm them up; returns the warm-up seconds.

    ``lm`` must be unquantized, on ``precision.device`` in its final dtype."""
    for module in lm.qwen.modules():
        if isinstance(module, MLP):
            module.compile(dynamic=True, options={"freezing": True})
    start = time.perf_counter()
    cache = KVCache.for_config(
        lm.cfg.qwen, 2, _WARM_UP_PREFILL + 2, precision.kv_cache_dtype, precision.device
    )
    slots = [cache.allocate(), cache.allocate()]
    tokens = torch.zeros(2, dtype=torch.long, device=precision.torch_device)
    with torch.inference_mode():
        for slot in slots:
            lm.prefill(lm.speech_embedding(tokens[:1].expand(_WARM_UP_PREFILL)), slot, cache)
        lm.decode(tokens[:1], slots[:1], cache)
        lm.decode(tokens, slots, cache)
    seconds = time.perf_counter() - start
    logger.info("compiled the LM's MLPs in %.1f s", seconds)
    return seconds
