"""oneDNN's int8 matmul for calls of several rows: the bits of fbgemm's, in Linears, in
whole LM steps and in traced decode steps. Runs where oneDNN is used: a CPU with AMX."""

import pytest
import torch

from cosyserve.accel.machine import Machine
from cosyserve.accel.onednn_int8 import MIN_OUTPUTS, MIN_ROWS, OneDnnPacker
from cosyserve.accel.precision import Precision
from cosyserve.accel.quantize import Int8DynamicLinear, quantize_lm_
from cosyserve.engine.decode_graphs import DecodeGraphs, TraceCapture
from cosyserve.modeldir.hparams import LMConfig, Qwen2Config
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.lm import CosyVoice2LM
from cosyserve.weights.randomize import randomize_
from tests.accel.test_quantize_fusion import DYNAMIC_INT8, int8_linear, mixed_rows

pytestmark = DYNAMIC_INT8
THIS_CPU = Machine.detect().cpu

# Wide enough that every Linear takes oneDNN from MIN_ROWS rows on (out features x 2 rows
# >= MIN_OUTPUTS), with small vocabularies to stay fast.
WIDE = LMConfig(
    qwen=Qwen2Config(
        hidden_size=512,
        intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=1024,
    ),
    speech_token_size=200,
    llm_input_size=512,
    llm_output_size=512,
)


@pytest.fixture(scope="module")
def packer() -> OneDnnPacker:
    packer = OneDnnPacker.create() if THIS_CPU.amx else None
    if packer is None:
        pytest.skip("oneDNN's int8 matmul is used only on CPUs with AMX tiles (the plan's onednn_int8)")
    return packer


@pytest.mark.parametrize(("in_features", "out_features"), [(256, 1024), (1024, 512), (64, 48)])
def test_several_rows_give_fbgemms_bits(packer: OneDnnPacker, in_features: int, out_features: int) -> None:
    int8 = int8_linear(in_features, out_features, seed=out_features, std=0.05)
    with torch.inference_mode():
        counts = [1, 2, 3, 5, 8, 16, 21, 22, 23, 40, 100]
        want = [int8(mixed_rows(n, in_features, n)) for n in counts]
        int8.onednn = packer.pack(int8.packed)
        # Small products (64 x 48) are left to fbgemm up to MIN_OUTPUTS outputs: oneDNN's
        # kernel for them scales its sums in another order.
        assert int8.onednn is not None or out_features * MIN_ROWS < MIN_OUTPUTS
        if int8.onednn is not None:
            assert int8.onednn.min_rows == max(MIN_ROWS, -(-MIN_OUTPUTS // out_features))
        got = [int8(mixed_rows(n, in_features, n)) for n in counts]
        batch = mixed_rows(6, in_features, 0).view(2, 3, in_features)  # any leading shape
        int8.onednn = None
        want_batch = int8(batch)
        int8.onednn = packer.pack(int8.packed)
        got_batch = int8(batch)
    for n, g, w in zip(counts, got, want, strict=True):
        assert torch.equal(g, w), f"{n} rows"
    assert torch.equal(got_batch, want_batch)


def _wide_lm() -> CosyVoice2LM:
    lm = CosyVoice2LM(WIDE)
    randomize_(lm, torch.Generator().manual_seed(0))
    quantize_lm_(lm.eval(), Precision.resolve(quantize="int8"), native=THIS_CPU, onednn=True)
    return lm


def _prefilled(lm: CosyVoice2LM, slots: int) -> tuple[KVCache, list[int], list[torch.Tensor]]:
    cache = KVCache.for_config(WIDE.qwen, slots + 1, 256)
    active, outputs = [], []
    for seed, length in enumerate((30, 41, 52)):
        ids = torch.randint(
            0, WIDE.speech_token_size, (length,), generator=torch.Generator().manual_seed(seed)
        )
        active.append(cache.allocate())
        outputs.append(lm.prefill(lm.speech_embedding(ids), active[-1], cache))
    return cache, active, outputs


def test_lm_prefill_and_traced_steps_give_fbgemms_bits(packer: OneDnnPacker) -> None:
    lm = _wide_lm()
    linears = [m for m in lm.modules() if isinstance(m, Int8DynamicLinear)]
    assert linears and all(m.onednn is not None for m in linears)
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, WIDE.speech_token_size, (n,), generator=gen) for n in (3, 1, 2, 3)]
    with torch.inference_mode():
        cache, slots, prefills = _prefilled(lm, 3)
        graphs = DecodeGraphs.for_engine(lm, cache, TraceCapture(lm), max_batch=4)
        assert len(graphs.replays) == 2  # traced, with the oneDNN weights as inputs
        replayed = [graphs.decode(t, slots[: len(t)]) for t in tokens]
        onednn = [m.onednn for m in linears]
        for m in linears:
            m.onednn = None
        fbgemm_cache, fbgemm_slots, fbgemm_prefills = _prefilled(lm, 3)
        eager = [lm.decode(t, fbgemm_slots[: len(t)], fbgemm_cache) for t in tokens]
        for m, weight in zip(linears, onednn, strict=True):
            m.onednn = weight
    for got, want in zip(prefills + replayed, fbgemm_prefills + eager, strict=True):
        assert torch.equal(got, want)
