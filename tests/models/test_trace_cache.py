"""Traces kept on disk (``TraceCache``): a decode step's from the cache gives a fresh
trace's bits (float32 and int8 Linears), holds none of the weights and reads the live
state; a trace is made again where its key changed or its file is unusable, and one the
cache cannot keep still runs. The flow's cached traces are tested with the flow's
(``tests/models/flow/test_traced_steps.py``)."""

import copy
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cosyserve.accel.precision import Precision
from cosyserve.accel.quantize import quantize_lm_
from cosyserve.engine.decode_graphs import DecodeGraphs, TraceCapture
from cosyserve.models import trace_cache
from cosyserve.models.lm import CosyVoice2LM
from cosyserve.models.trace_cache import TraceCache
from tests.engine.test_decode_graphs import CFG, _prefilled


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """One entry per trace made (not taken from the cache)."""
    return count_traces(monkeypatch)


def count_traces(monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """A list that gets one entry per trace the cache makes (not taken from a file)."""
    made: list[None] = []
    trace = trace_cache.trace_frozen

    def counted(module: torch.nn.Module, inputs: list[torch.Tensor]) -> torch.jit.ScriptModule:
        made.append(None)
        return trace(module, inputs)

    monkeypatch.setattr(trace_cache, "trace_frozen", counted)
    return made


@pytest.fixture(params=["fp32", "int8"])
def decoder(request: pytest.FixtureRequest, lm: CosyVoice2LM) -> CosyVoice2LM:
    """The tiny LM, float32 or with int8 Linears (packed weights: objects, not tensors)."""
    copied = copy.deepcopy(lm)
    if request.param == "int8":
        quantize_lm_(copied, Precision.resolve(quantize="int8"))
    return copied


def _decode_graphs(lm: CosyVoice2LM, cache: TraceCache) -> Iterator[DecodeGraphs]:
    """The engine's decode replays of ``lm``, each call on a new KV cache with the same prompts."""
    while True:
        kv, _ = _prefilled(lm, 4, 128)
        yield DecodeGraphs.for_engine(lm, kv, TraceCapture(lm, cache), max_batch=4)


def _same_steps(first: DecodeGraphs, second: DecodeGraphs) -> None:
    gen = torch.Generator().manual_seed(3)
    for active in ([0, 1, 2], [1], [2, 0], [0, 1, 2], [0]):
        tokens = torch.randint(0, CFG.speech_token_size, (len(active),), generator=gen)
        assert torch.equal(first.decode(tokens, active), second.decode(tokens, active))
    assert torch.equal(first.cache.k, second.cache.k) and torch.equal(first.cache.v, second.cache.v)


@torch.inference_mode()
def test_cached_decode_traces_give_the_fresh_traces_bits(
    decoder: CosyVoice2LM, tmp_path: Path, traced: list[None]
) -> None:
    graphs = _decode_graphs(decoder, TraceCache(tmp_path, "model"))
    fresh = next(graphs)
    assert len(traced) == 2 and len(list(tmp_path.glob("decode-*.pt"))) == 2
    cached = next(graphs)
    assert len(traced) == 2  # both from the files
    _same_steps(fresh, cached)
    weights = sum(t.numel() * t.element_size() for t in decoder.state_dict().values())
    assert all(path.stat().st_size < weights / 20 for path in tmp_path.iterdir())


@torch.inference_mode()
def test_another_key_or_shape_is_traced_again(lm: CosyVoice2LM, tmp_path: Path, traced: list[None]) -> None:
    next(_decode_graphs(lm, TraceCache(tmp_path, "model")))
    next(_decode_graphs(lm, TraceCache(tmp_path, "another model")))
    assert len(traced) == 4
    kv = _prefilled(lm, 5, 128)[0]  # a KV cache of another size: the step reads it
    DecodeGraphs.for_engine(lm, kv, TraceCapture(lm, TraceCache(tmp_path, "model")), max_batch=4)
    assert len(traced) == 6 and len(list(tmp_path.iterdir())) == 6


@pytest.mark.parametrize("damage", [b"", b"not a trace", "another trace's"])
@torch.inference_mode()
def test_an_unusable_file_is_traced_again_and_replaced(
    lm: CosyVoice2LM,
    tmp_path: Path,
    traced: list[None],
    caplog: pytest.LogCaptureFixture,
    damage: bytes | str,
) -> None:
    graphs = _decode_graphs(lm, TraceCache(tmp_path, "model"))
    fresh = next(graphs)
    files = sorted(tmp_path.iterdir())
    contents = [path.read_bytes() for path in files]
    for path, other in zip(files, reversed(contents), strict=True):
        path.write_bytes(other if isinstance(damage, str) else damage)
    with caplog.at_level(logging.WARNING):
        retraced = next(graphs)
    assert len(traced) == 4
    assert sum("is unusable" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 2
    _same_steps(fresh, retraced)
    next(graphs)
    assert len(traced) == 4  # the files were written anew


def test_the_key_names_torch_and_the_source(tmp_path: Path) -> None:
    cache = TraceCache.create("model", tmp_path)
    assert cache.directory == tmp_path
    assert cache.key.startswith("model\n") and f"torch {torch.__version__}" in cache.key
    assert TraceCache.create("model", tmp_path) == cache != TraceCache.create("another model", tmp_path)


class _ReadsOutside(torch.nn.Module):
    """Adds a tensor that is not the module's (as a decode step reads the KV cache)."""

    def __init__(self, outside: torch.Tensor) -> None:
        super().__init__()
        self.outside = [outside]  # a list: not one of the module's tensors

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outside[0]


def test_state_is_bound_to_the_live_tensor_and_what_is_not_named_is_not_kept(
    tmp_path: Path, traced: list[None], caplog: pytest.LogCaptureFixture
) -> None:
    outside, x = torch.zeros(1 << 20), torch.ones(1 << 20)
    module, cache = _ReadsOutside(outside), TraceCache(tmp_path, "model")
    with caplog.at_level(logging.INFO):
        cache.frozen("add", module, [x], {})  # 4 MiB of a constant of its own: no file
    assert "is not kept" in caplog.text and not list(tmp_path.iterdir())
    cache.frozen("add", module, [x], {"outside": outside})
    (path,) = tmp_path.iterdir()
    assert path.stat().st_size < 1 << 16
    cached = cache.frozen("add", module, [x], {"outside": outside})
    assert len(traced) == 2
    outside.fill_(2.0)  # the cached trace reads the tensor itself, not a copy
    assert torch.equal(cached(x), torch.full_like(x, 3.0))


@torch.inference_mode()
def test_a_cache_that_cannot_be_written_still_traces(
    lm: CosyVoice2LM, tmp_path: Path, traced: list[None], caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "traces"
    blocked.write_text("a file where the directory would be")
    with caplog.at_level(logging.WARNING):
        graphs = next(_decode_graphs(lm, TraceCache(blocked, "model")))
    assert len(traced) == 2 and caplog.text.count("is not kept") == 2
    assert graphs.replays and blocked.is_file()
