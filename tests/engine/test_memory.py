"""Nothing accumulates per request: 200 requests leave memory where the first 50 left it."""

import gc
import weakref
from collections import Counter

import pytest
import torch

from cosyserve.bench.engine_runs import make_engine
from cosyserve.bench.workload import synthetic_spec, synthetic_text_ids, synthetic_voice
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel
from cosyserve.engine.request import GenerationSpec, Request, SegmentState, StepOutput

WARM_UP, TOTAL, IN_FLIGHT, VOICES = 50, 200, 8, 12
# Measured on the tiny model: after the warm-up, RSS still rises by about 2-6 MB per 150
# requests and less with every batch (allocator high-water marks, not objects: the object
# counts below do not move). 16 MB leaves room for that and still catches any per-request
# leak of more than ~110 KB, e.g. a request's output audio (~40 KB here) plus its decode
# state, or anything tensor-sized on the full model; smaller leaks of engine objects or
# tensors are caught exactly by the object counts.
RSS_GROWTH_BOUND_MB = 16.0


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def live_objects() -> Counter[type]:
    """Live tensors and engine objects by type (exact types: isinstance on every object
    of the heap would run odd __instancecheck__ hooks)."""
    gc.collect()
    kinds = {
        torch.Tensor,
        torch.nn.Parameter,
        Request,
        SegmentState,
        GenerationSpec,
        StepOutput,
        torch.Generator,
    }
    return Counter(t for t in map(type, gc.get_objects()) if t in kinds)


def run(engine: Engine, model: LoadedModel, first: int, last: int) -> list[weakref.ref[Request]]:
    """Requests first..last-1, IN_FLIGHT at a time (mixed voices, lengths, streaming)."""
    hp = model.hparams
    voices = [synthetic_voice(hp, 0.2, seed=v) for v in range(VOICES)]
    pending = list(range(first, last))
    refs = []
    while pending or engine.has_work():
        while pending and len(engine.scheduler) < IN_FLIGHT:
            i = pending.pop(0)
            engine.add(
                synthetic_spec(
                    f"mem-{i}",
                    voices[i % VOICES],
                    synthetic_text_ids(hp, 6, seed=i),
                    tokens=5 + i % 5,
                    seed=i,
                    stream=i % 8 == 0,
                    first_hop=5 if i % 16 == 0 else None,
                )
            )
            refs.append(weakref.ref(engine.scheduler.waiting[-1]))
        for out in engine.step():
            assert out.error is None
    return refs


@pytest.mark.slow  # a soak: the engine's own tests free every request's state one by one
def test_two_hundred_requests_leave_no_trace(tiny_model: LoadedModel) -> None:
    engine = make_engine(tiny_model, max_active=IN_FLIGHT)
    run(engine, tiny_model, 0, WARM_UP)
    objects, rss = live_objects(), rss_mb()
    refs = run(engine, tiny_model, WARM_UP, TOTAL)
    growth = rss_mb() - rss
    assert live_objects() == objects
    assert all(ref() is None for ref in refs)
    assert engine.active_requests == 0 and len(engine.scheduler) == 0
    cache = engine.lm_runner.cache
    assert cache.free_slots == engine.config.max_active  # every request slot (not the scratch slot)
    assert engine.prefix_cache is not None and len(engine.prefix_cache) <= engine.prefix_cache.max_blocks
    assert engine.stats.flow_rows >= TOTAL
    assert growth <= RSS_GROWTH_BOUND_MB, f"RSS grew by {growth:.1f} MB over {TOTAL - WARM_UP} requests"
