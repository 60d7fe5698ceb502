"""Under int8 a sequence's LM output is the same bits alone, beside longer sequences in a
decode step, and in any split of its prompt into prefill chunks.

The LM here has the released model's attention geometry (14 query heads of 64 over 2 key
heads) in two small layers: torch's attention kernel, masked over a longer span, moved
such a row's log-probs by up to 0.19 on the full model (the run diary ``docs/benchmarks.md``,
"A row's output in a batch", in git history at 3099e5e).
"""

import dataclasses

import pytest
import torch

from cosyserve.accel.machine import Machine
from cosyserve.accel.plan import Choices, choose_plan
from cosyserve.accel.precision import Precision
from cosyserve.accel.quantize import quantize_lm_
from cosyserve.engine.decode_graphs import DecodeGraphs, EagerCapture
from cosyserve.modeldir.presets import TINY
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.lm import CosyVoice2LM

HIDDEN = 896
QWEN = dataclasses.replace(
    TINY.lm.qwen,
    hidden_size=HIDDEN,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=14,
    num_key_value_heads=2,
)
CFG = dataclasses.replace(TINY.lm, qwen=QWEN, llm_input_size=HIDDEN, llm_output_size=HIDDEN)


@pytest.fixture(scope="module")
def lm() -> CosyVoice2LM:
    torch.manual_seed(0)
    model = CosyVoice2LM(CFG)
    # On the kernels this CPU's plan would use: a row's bits must not depend on its batch there.
    plan = choose_plan(Machine.detect(), "fast", Choices(dtype="bf16", quantize="int8"))
    native = plan.machine.cpu if plan.native_int8 else None
    quantize_lm_(model, Precision.resolve("bf16", "int8"), native=native, onednn=plan.onednn_int8)
    model.lay_out_head_for_decode_()
    return model.eval().requires_grad_(False)


def _prompt(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, HIDDEN, generator=gen)


@torch.inference_mode()
def test_a_rows_decode_step_is_the_same_beside_longer_rows(lm: CosyVoice2LM) -> None:
    cache = KVCache.for_config(QWEN, 3, 1024)
    slots = [cache.allocate() for _ in range(3)]
    lengths = (50, 130, 700)  # past 512 keys, where torch's kernel splits its sums
    for slot, length in zip(slots, lengths, strict=True):
        lm.prefill(_prompt(length, slot), slot, cache)
    tokens = torch.tensor([5, 7, 11])
    alone = []
    for i, slot in enumerate(slots):
        alone.append(lm.decode(tokens[i : i + 1], [slot], cache)[0])
        cache.truncate(slot, lengths[i])
    together = lm.decode(tokens, slots, cache)
    for i in range(3):
        assert torch.equal(together[i], alone[i]), lengths[i]


@torch.inference_mode()
def test_a_prompt_gives_the_same_bits_in_any_prefill_split(lm: CosyVoice2LM) -> None:
    cache = KVCache.for_config(QWEN, 2, 512)
    whole, split = cache.allocate(), cache.allocate()
    prompt = _prompt(88, 3)
    want = lm.prefill(prompt, whole, cache)
    for start, stop in ((0, 40), (40, 41), (41, 88)):
        got = lm.prefill(prompt[start:stop], split, cache)
    assert torch.equal(got, want)
    assert all(
        torch.equal(a, b) for a, b in zip(cache.read(split, 0, 88), cache.read(whole, 0, 88), strict=True)
    )


@torch.inference_mode()
def test_a_static_decode_step_gives_the_eager_steps_bits(lm: CosyVoice2LM) -> None:
    # Batches padded to 4 rows, keys read up to a 128- or 256-key bucket under a mask.
    caches = [KVCache.for_config(QWEN, 4, 256) for _ in range(2)]
    lengths = (60, 100, 126)
    for cache in caches:
        for slot, length in enumerate(lengths):
            assert cache.allocate() == slot
            lm.prefill(_prompt(length, slot), slot, cache)
    eager, static = caches
    graphs = DecodeGraphs(lm, static, EagerCapture(), batch_sizes=(1, 4), spans=(128, 256))
    gen = torch.Generator().manual_seed(5)
    for active in ([0, 1, 2], [2], [1, 2], [0, 1, 2]):  # the last step passes 128 positions
        tokens = torch.randint(0, CFG.speech_token_size, (len(active),), generator=gen)
        assert torch.equal(graphs.decode(tokens, active), lm.decode(tokens, active, eager))
    assert static.length(2) > 128
