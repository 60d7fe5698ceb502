"""Our int8 kernel (``cosyserve.accel.native_int8``): fbgemm's bits in Linears, whole LM
steps and traced decode steps; its packer, switch and fallbacks. The kernel's tests run
where it builds (a CPU with AVX-512 VNNI and a C++ compiler)."""

import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from cosyserve.accel import native_int8
from cosyserve.accel.machine import Cpu, Machine
from cosyserve.accel.native_int8 import NativeInt8Packer
from cosyserve.accel.onednn_int8 import INPUT_SCALE, INPUT_ZERO_POINT
from cosyserve.accel.precision import Precision
from cosyserve.accel.quantize import Int8DynamicLinear, ao_quantize_dynamic, int8_dynamic_, quantize_lm_
from cosyserve.engine.decode_graphs import DecodeGraphs, TraceCapture
from cosyserve.modeldir.hparams import LMConfig, Qwen2Config
from cosyserve.models.kv_cache import KVCache
from cosyserve.models.lm import CosyVoice2LM
from cosyserve.weights.randomize import randomize_
from tests.accel.test_quantize_fusion import DYNAMIC_INT8, int8_linear, mixed_rows

pytestmark = DYNAMIC_INT8
THIS_CPU = Machine.detect().cpu
VNNI_CPU = Cpu("Cascade Lake", 2, avx2=True, avx512=True, vnni=True)

# Odd widths: inputs not a multiple of 4, outputs not a multiple of 16.
SMALL = LMConfig(
    qwen=Qwen2Config(
        hidden_size=72,
        intermediate_size=150,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=1024,
    ),
    speech_token_size=203,
    llm_input_size=72,
    llm_output_size=72,
)


@pytest.fixture(scope="module")
def packer() -> NativeInt8Packer:
    packer = NativeInt8Packer.create(INPUT_SCALE, INPUT_ZERO_POINT, THIS_CPU)
    if packer is None:
        pytest.skip("the int8 kernel runs only where it builds: AVX-512 VNNI and a C++ compiler")
    return packer


@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"),
    [
        (896, 1152, True),
        (4864, 896, False),
        (896, 6561, True),
        (130, 70, False),
        (7, 3, True),
        (2, 17, False),
    ],
)
def test_every_row_count_gets_fbgemms_bits(
    packer: NativeInt8Packer, in_features: int, out_features: int, bias: bool
) -> None:
    int8 = int8_linear(in_features, out_features, seed=out_features, std=0.05)
    if not bias:
        int8.bias = None
    assert int8.packed is not None
    counts = [1, 2, 3, 11, 12, 13, 24, 25, 100]
    with torch.inference_mode():
        want = [int8(mixed_rows(n, in_features, n)) for n in counts]
        batch = mixed_rows(6, in_features, 0).view(2, 3, in_features)  # any leading shape
        want_batch = int8(batch)
        int8.native = packer.pack(int8.packed, int8.bias, int8)
        assert int8.native is not None
        got = [int8(mixed_rows(n, in_features, n)) for n in counts]
        got_batch = int8(batch)
        rows = mixed_rows(7, in_features, 1)
        alone = torch.cat([int8(row[None]) for row in rows])
    for n, g, w in zip(counts, got, want, strict=True):
        assert torch.equal(g, w), f"{n} rows"
    assert torch.equal(got_batch, want_batch)
    assert torch.equal(alone, int8(rows))


def test_a_row_with_nan_gives_nan_and_leaves_its_neighbours(packer: NativeInt8Packer) -> None:
    int8 = int8_linear(64, 40, seed=0, std=0.05)
    assert int8.packed is not None
    rows = mixed_rows(3, 64, 0)
    rows[1, 5] = float("nan")
    with torch.inference_mode():
        want = int8(rows)
        int8.native = packer.pack(int8.packed, int8.bias, int8)
        got = int8(rows)
    assert bool(got[1].isnan().all()) and bool(want[1].isnan().all())
    assert torch.equal(got[[0, 2]], want[[0, 2]])


def test_a_shape_with_other_bits_stays_on_fbgemm(
    packer: NativeInt8Packer, caplog: pytest.LogCaptureFixture
) -> None:
    int8 = int8_linear(48, 33, seed=1, std=0.05)
    assert int8.packed is not None
    with caplog.at_level(logging.WARNING, logger="cosyserve.accel.native_int8"):
        refused = NativeInt8Packer(INPUT_SCALE, INPUT_ZERO_POINT).pack(
            int8.packed, int8.bias, lambda rows: int8(rows) + 1.0
        )
    assert refused is None
    assert "stay on fbgemm" in caplog.text


def test_the_op_refuses_mismatched_arguments(packer: NativeInt8Packer) -> None:
    int8 = int8_linear(64, 40, seed=0, std=0.05)
    assert int8.packed is not None
    native = packer.pack(int8.packed, int8.bias, int8)
    assert native is not None
    args = (
        native.weight,
        native.col_offsets,
        native.multipliers,
        native.bias,
        40,
        INPUT_SCALE,
        INPUT_ZERO_POINT,
    )
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.cosyserve.int8_rows(torch.randn(2, 60), *args)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.cosyserve.int8_rows(torch.randn(2, 64, dtype=torch.float64), *args)
    with pytest.raises(RuntimeError, match="outs does not match"):
        torch.ops.cosyserve.int8_rows(torch.randn(2, 64), *args[:4], 80, *args[5:])


def _small_lm(native: bool) -> CosyVoice2LM:
    lm = CosyVoice2LM(SMALL)
    randomize_(lm, torch.Generator().manual_seed(0))
    quantize_lm_(lm.eval(), Precision.resolve(quantize="int8"), native=THIS_CPU if native else None)
    return lm


def _run(lm: CosyVoice2LM, traced: bool) -> list[torch.Tensor]:
    """Three prefills, then decode steps of 3, 1, 2 and 3 rows (traced or eager)."""
    cache = KVCache.for_config(SMALL.qwen, 4, 256)
    gen = torch.Generator().manual_seed(3)
    slots, outputs = [], []
    with torch.inference_mode():
        for length in (30, 41, 52):
            slots.append(cache.allocate())
            ids = torch.randint(0, SMALL.speech_token_size, (length,), generator=gen)
            outputs.append(lm.prefill(lm.speech_embedding(ids), slots[-1], cache))
        graphs = DecodeGraphs.for_engine(lm, cache, TraceCapture(lm), max_batch=3) if traced else None
        for n in (3, 1, 2, 3):
            tokens = torch.randint(0, SMALL.speech_token_size, (n,), generator=gen)
            step = graphs.decode(tokens, slots[:n]) if graphs else lm.decode(tokens, slots[:n], cache)
            outputs.append(step)
    return outputs


def test_lm_prefills_and_traced_steps_give_fbgemms_bits(packer: NativeInt8Packer) -> None:
    lm = _small_lm(native=True)
    linears = [m for m in lm.modules() if isinstance(m, Int8DynamicLinear)]
    # Every Linear on the kernel, fbgemm's copy of its weights gone.
    assert linears and all(m.native is not None and m.packed is None for m in linears)
    reference = _small_lm(native=False)
    assert all(
        m.native is None and m.packed is not None
        for m in reference.modules()
        if isinstance(m, Int8DynamicLinear)
    )
    got = _run(lm, traced=True)
    want = _run(reference, traced=False)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_only_the_plans_int8_kernel_packs_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantizing without the plan's CPU never touches the kernel, whatever this CPU has."""
    monkeypatch.setattr(NativeInt8Packer, "create", classmethod(lambda *_: pytest.fail("packed")))
    lm = _small_lm(native=False)
    assert all(
        m.native is None and m.packed is not None for m in lm.modules() if isinstance(m, Int8DynamicLinear)
    )


def test_a_cpu_without_vnni_never_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda **_: pytest.fail("built on a CPU that cannot run it"))
    assert native_int8.load.__wrapped__(Cpu("Zen 3", 2, avx2=True)) is False
    assert native_int8.load.__wrapped__(Cpu("Skylake", 2, avx2=True, avx512=True)) is False


def test_a_failed_build_leaves_fbgemm(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from torch.utils import cpp_extension

    calls: list[dict[str, object]] = []

    def no_compiler(**kwargs: object) -> None:
        calls.append(kwargs)
        raise RuntimeError("Error building extension 'cosyserve_int8_rows'")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="cosyserve.accel.native_int8"):
        assert native_int8.load.__wrapped__(VNNI_CPU) is False
    assert "could not be built (RuntimeError" in caplog.text
    assert "Install a C++ compiler (g++)" in caplog.text
    # Built in a directory of this installed source's own.
    (call,) = calls
    assert Path(str(call["build_directory"])).name.startswith("cosyserve_int8_rows-")


def test_the_ninja_wheel_goes_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", "/nonexistent")
    native_int8._put_ninja_on_path()
    assert shutil.which("ninja") == str(Path(ninja.BIN_DIR) / "ninja")


def test_without_the_kernel_fbgemm_keeps_its_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    linear = nn.Sequential(nn.Linear(32, 24))
    quantize_dynamic = ao_quantize_dynamic()
    assert quantize_dynamic is not None
    int8_dynamic_([linear], quantize_dynamic, None, None)
    int8 = linear[0]
    assert isinstance(int8, Int8DynamicLinear)
    assert int8.native is None and int8.packed is not None
    assert int8(torch.randn(2, 32)).shape == (2, 24)
