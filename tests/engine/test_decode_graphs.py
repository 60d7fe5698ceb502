"""Decode steps replayed from static buffers (``decode_graphs``) against eager steps.

On CPU the steps are recorded as TorchScript traces (:class:`TraceCapture`, the
engine's default) or "captured" by :class:`EagerCapture` (a replay runs the step again
on the same buffers), which checks everything but the recording itself: padding to a
captured batch size, the scratch slot, spans and their masks, and the cache's
bookkeeping. The CUDA test records real CUDA graphs; it runs where a GPU is present.
"""

import copy
import logging
import threading

import pytest
import torch
from torch import nn

from cosyserve.bench.engine_runs import make_engine, mixed_specs, run_together
from cosyserve.engine.config import EngineConfig
from cosyserve.engine.decode_graphs import (
    Capture,
    CudaGraphCapture,
    DecodeGraphs,
    EagerCapture,
    TraceCapture,
    buckets,
)
from cosyserve.engine.engine import Engine
from cosyserve.engine.loader import LoadedModel
from cosyserve.modeldir.presets import TINY
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.lm import CosyVoice2LM
from tests.engine.helpers import assert_same

CFG = TINY.lm
LENGTHS = (50, 57, 62)


def _prefilled(
    lm: CosyVoice2LM, max_slots: int, max_len: int, device: str = "cpu"
) -> tuple[KVCache, list[int]]:
    """A cache whose first slots hold prompts of LENGTHS positions (the same on every call)."""
    cache = KVCache.for_config(CFG.qwen, max_slots, max_len, device=device)
    slots = []
    for seed, length in enumerate(LENGTHS):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, CFG.speech_token_size, (length,), generator=gen)
        slot = cache.allocate()
        lm.prefill(lm.speech_embedding(ids.to(device)), slot, cache)
        slots.append(slot)
    return cache, slots


def _graphs(lm: CosyVoice2LM, cache: KVCache, capture: Capture) -> DecodeGraphs:
    """Buckets of 1, 2 and 4 rows over 64 and 128 keys; for a shape-free capture, the
    engine's: a lone row, and up to 4 rows over any span."""
    if capture.shape_free:
        return DecodeGraphs.for_engine(lm, cache, capture, max_batch=4)
    return DecodeGraphs(lm, cache, capture, batch_sizes=(1, 2, 4), spans=(64, 128))


def _compare_steps(lm: CosyVoice2LM, device: str, capture: Capture, steps: int = 9) -> None:
    """Eager steps on one cache against replayed steps on another with the same prompts:
    batches of 3 (padded to 4 in buckets), 1 and 2, the longest sequence growing from a
    64-position span into a 128-position one."""
    eager_cache, slots = _prefilled(lm, 3, 128, device)
    graph_cache, graph_slots = _prefilled(lm, 4, 128, device)  # + the scratch slot
    assert graph_slots == slots
    graphs = _graphs(lm, graph_cache, capture)
    # Buckets keep a scratch slot for padded rows; shape-free steps give it back.
    assert graphs.pad_slot not in slots
    assert graph_cache.free_slots == (1 if capture.shape_free else 0)
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        active = (slots, slots[:1], slots[1:])[step % 3]
        tokens = torch.randint(0, CFG.speech_token_size, (len(active),), generator=gen).to(device)
        want = lm.decode(tokens, active, eager_cache)
        got = graphs.decode(tokens, active)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert max(graph_cache.length(s) for s in slots) > 64  # the span grew past a key block
    for slot in slots:
        length = eager_cache.length(slot)
        assert graph_cache.length(slot) == length
        got_kv, want_kv = graph_cache.read(slot, 0, length), eager_cache.read(slot, 0, length)
        torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5)
    if graphs.pad_slot is not None:
        assert graph_cache.length(graphs.pad_slot) == 0


@torch.inference_mode()
def test_replayed_steps_match_eager_steps(lm: CosyVoice2LM) -> None:
    _compare_steps(lm, "cpu", EagerCapture())


@torch.inference_mode()
def test_replayed_shape_free_steps_match_eager_steps(lm: CosyVoice2LM) -> None:
    _compare_steps(lm, "cpu", EagerCapture(shape_free=True))


@torch.inference_mode()
def test_traced_steps_match_eager_steps(lm: CosyVoice2LM) -> None:
    _compare_steps(lm, "cpu", TraceCapture(lm))


@torch.inference_mode()
def test_a_traced_step_computes_what_the_static_step_computes(lm: CosyVoice2LM) -> None:
    # Two caches with the same prompts: one replayed from two traces (made at 1 and 4 rows
    # over 128 keys), one by running the step again. The traced ops are the step's own at
    # every batch and span, so every output is the same, bit for bit.
    caches = [_prefilled(lm, 4, 128)[0] for _ in range(2)]
    traced, rerun = (
        DecodeGraphs.for_engine(lm, cache, capture, max_batch=4)
        for cache, capture in zip(caches, (TraceCapture(lm), EagerCapture(shape_free=True)), strict=True)
    )
    assert list(traced.replays) == [(4, 128), (1, 128)]
    gen = torch.Generator().manual_seed(3)
    for active in ([0, 1, 2], [1], [2, 0], [0, 1, 2], [0], [1, 2]):
        tokens = torch.randint(0, CFG.speech_token_size, (len(active),), generator=gen)
        assert torch.equal(traced.decode(tokens, active), rerun.decode(tokens, active))
    assert max(caches[0].length(s) for s in range(3)) > 64  # spans of 64 and then 128 keys
    # The requests' slots (the traces' runs at capture wrote into the scratch slot too).
    assert torch.equal(caches[0].k[:, :3], caches[1].k[:, :3])
    assert torch.equal(caches[0].v[:, :3], caches[1].v[:, :3])


@torch.inference_mode()
def test_traces_captured_on_an_empty_cache_replay_each_steps_buffers(lm: CosyVoice2LM) -> None:
    """Captured first, as the engine does: the scratch slot is slot 0, so the tokens and
    slots buffers both hold zeros when traced, which freezing would pool into one constant
    were they not the traces' inputs (a lone row then replayed the captured token)."""
    cache = KVCache.for_config(CFG.qwen, 4, 128)
    graphs = DecodeGraphs.for_engine(lm, cache, TraceCapture(lm), max_batch=4)
    eager_cache, slots = _prefilled(lm, 3, 128)
    for slot in slots:
        assert cache.allocate() == slot
        cache.load_prefix(slot, *eager_cache.read(slot, 0, eager_cache.length(slot)))
    gen = torch.Generator().manual_seed(5)
    for active in ([0], [2], [1, 2], [1], [0, 1, 2]):
        tokens = torch.randint(1, CFG.speech_token_size, (len(active),), generator=gen)
        assert torch.equal(graphs.decode(tokens, active), lm.decode(tokens, active, eager_cache)), active


@torch.inference_mode()
def test_shape_free_steps_give_back_the_slot_their_captures_wrote(lm: CosyVoice2LM) -> None:
    cache = KVCache.for_config(CFG.qwen, 2, 128)
    graphs = DecodeGraphs.for_engine(lm, cache, TraceCapture(lm), max_batch=2)
    assert graphs.pad_slot is None and cache.free_slots == 2
    # Free slots hold zeros (KVCache.free): the captures' keys and values are gone.
    assert not cache.k.any() and not cache.v.any()


@torch.inference_mode()
def test_a_trace_runs_once_when_it_is_captured(lm: CosyVoice2LM, monkeypatch: pytest.MonkeyPatch) -> None:
    # Its first run builds what the process keeps of it: at start, not amid a burst's tensors.
    runs: list[nn.Module] = []

    class Counted(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, shape: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
            runs.append(self.module)
            out: torch.Tensor = self.module(shape, *inputs)
            return out

    monkeypatch.setattr(torch.jit, "trace", lambda module, *args, **kwargs: Counted(module))
    monkeypatch.setattr(torch.jit, "freeze", lambda module: module)
    cache, _ = _prefilled(lm, 4, 128)
    DecodeGraphs(lm, cache, TraceCapture(lm), batch_sizes=(1, 2), spans=(64, 128))
    assert len(runs) == 4  # one per trace


@torch.inference_mode()
def test_an_lm_that_cannot_be_traced_runs_its_steps_eagerly(
    lm: CosyVoice2LM, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("not traceable")

    monkeypatch.setattr(torch.jit, "trace", refuse)
    cache, slots = _prefilled(lm, 4, 128)
    with caplog.at_level(logging.WARNING, "cosyserve.engine.decode_graphs"):
        graphs = DecodeGraphs(lm, cache, TraceCapture(lm), batch_sizes=(1, 2), spans=(64, 128))
    assert [r.message for r in caplog.records] == [
        "decode steps run eagerly: the LM could not be traced (RuntimeError)"
    ]
    eager_cache, _ = _prefilled(lm, 3, 128)
    tokens = torch.tensor([3, 4])
    torch.testing.assert_close(
        graphs.decode(tokens, slots[:2]), lm.decode(tokens, slots[:2], eager_cache), rtol=1e-5, atol=1e-5
    )


@torch.inference_mode()
def test_refuses_what_no_graph_fits(lm: CosyVoice2LM) -> None:
    cache, slots = _prefilled(lm, 4, 128)
    graphs = DecodeGraphs(lm, cache, EagerCapture(), batch_sizes=(1, 2), spans=(128,))
    with pytest.raises(ValueError, match="exceeds the largest captured, 2"):
        graphs.decode(torch.zeros(3, dtype=torch.long), slots)
    with pytest.raises(ValueError, match="scratch slot"):
        graphs.decode(torch.zeros(1, dtype=torch.long), [graphs.pad_slot])
    with pytest.raises(ValueError, match="one per slot"):
        graphs.decode(torch.zeros(2, dtype=torch.long), slots[:1])
    assert [cache.length(s) for s in slots] == list(LENGTHS)  # refused steps changed nothing
    with pytest.raises(ValueError, match="end at the capacity 128"):
        DecodeGraphs(lm, cache, EagerCapture(), batch_sizes=(1,), spans=(64,))
    with pytest.raises(ValueError, match="whole key blocks of 64"):
        DecodeGraphs(lm, cache, EagerCapture(), batch_sizes=(1,), spans=(100, 128))
    with pytest.raises(ValueError, match="ascending"):
        DecodeGraphs(lm, cache, EagerCapture(), batch_sizes=(2, 1), spans=(128,))
    with pytest.raises(ValueError, match="a lone row"):
        DecodeGraphs(lm, cache, EagerCapture(shape_free=True), batch_sizes=(2,), spans=(128,))


def test_buckets_double_up_to_the_limit() -> None:
    assert buckets(8, 1) == (1, 2, 4, 8)
    assert buckets(6, 1) == (1, 2, 4, 6)
    assert buckets(1, 1) == (1,)
    assert buckets(2048, 128) == (128, 256, 512, 1024, 2048)


def test_engine_traces_decode_steps_on_a_cpu_by_default(tiny_model: LoadedModel) -> None:
    model = tiny_model
    config = EngineConfig(max_active=4, max_len=256)
    engine = Engine(model.lm, model.flow, model.hift, config)
    graphs = engine.lm_runner.decode_graphs
    # Two traces: a lone row, and up to 4 rows, each over any span.
    assert graphs is not None and graphs.shape_free
    assert graphs.batch_sizes == (1, 4) and graphs.spans == (256,)
    assert len(graphs.replays) == 2 and engine.lm_runner.cache.max_slots == 4  # no scratch slot
    # Traced on a thread of its own: no thread but the caller's is left behind.
    assert not any(t.name == "cosyserve-trace" for t in threading.enumerate())


def test_engine_with_replayed_steps_gives_the_same_requests(tiny_model: LoadedModel) -> None:
    specs = mixed_specs(tiny_model, count=6)
    eager = make_engine(tiny_model, max_active=4, traced_decode=False)
    assert eager.lm_runner.decode_graphs is None
    model = tiny_model
    replayed = Engine(model.lm, model.flow, model.hift, eager.config, decode_capture=EagerCapture())
    graphs = replayed.lm_runner.decode_graphs
    assert graphs is not None and graphs.batch_sizes == (1, 2, 4)
    assert replayed.lm_runner.cache.max_slots == 5
    assert_same(run_together(replayed, specs), run_together(eager, specs), [s.request_id for s in specs])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@torch.inference_mode()
def test_cuda_graph_steps_match_eager_steps(lm: CosyVoice2LM) -> None:
    device = torch.device("cuda")
    # A copy: the module's fixture stays on the CPU for the other tests, pass or fail.
    _compare_steps(copy.deepcopy(lm).to(device), "cuda", CudaGraphCapture(device))
