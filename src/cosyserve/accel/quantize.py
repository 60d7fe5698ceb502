"""Weight quantization of the LM's decoder-layer Linear modules, and float16 storage of
the flow estimator's, in place.

Only ``lm.qwen.layers`` is touched, and with dynamic int8 on a CPU the 6564-way speech
head (:func:`quantize_lm_` says why): the layers' Linear weights are 71 % of the LM's
parameters and nearly all of a decode step's memory traffic. The text embedding (a
lookup) and the speech embedding keep their dtype, so prompt encoding loses nothing
beyond what the layers add.

CPU int8 has two implementations:

- dynamic (``torch.ao.quantization.quantize_dynamic``): int8 weights per output channel,
  activations quantized per call, each input row on its own scale
  (:class:`Int8DynamicLinear`: a request's output does not depend on its batch);
  on CPUs with AVX-512 VNNI our own kernel (:mod:`cosyserve.accel.native_int8`), else
  fbgemm's int8 GEMM, with oneDNN's for calls of several rows on CPUs with AMX. torch marks
  ``torch.ao.quantization`` deprecated in favour of torchao, whose CPU int8 is only fast
  under ``torch.compile``; while it exists, it is used.
- weight-only (:class:`Int8WeightOnlyLinear`, ``aten._weight_int8pack_mm``): int8 weights,
  bfloat16 activations. Slower at batch 16 but never quantizes activations, so outlier
  channels cannot cost accuracy; it is the ``int8wo`` setting and the fallback of ``int8``
  on a torch without ``quantize_dynamic``.

CUDA int8/int4 go through torchao (weight-only int8; int4 with grouped scales on the
tinygemm kernel, which needs bfloat16 activations).

The flow estimator's Linears can keep float16 weights (:class:`Fp16WeightLinear`,
``flow_quantize = fp16``): a stream's small chunk runs 10 Euler steps of 20-100 rows, and
fbgemm's float16-weight GEMM runs those about twice as fast as the float32 one on an
AVX2 CPU (half the bytes to read, with a kernel made for few rows), computing in float32
(``docs/precision.md``, "How each choice works").
"""

import importlib
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from cosyserve.accel.machine import Cpu
from cosyserve.accel.native_int8 import NativeInt8Packer, NativeInt8Weight
from cosyserve.accel.onednn_int8 import INPUT_SCALE, INPUT_ZERO_POINT, OneDnnInt8Weight, OneDnnPacker
from cosyserve.accel.precision import Precision, PrecisionError, Quantization, require_torchao
from cosyserve.memory import PageReleaser
from cosyserve.models.qwen2 import DecoderLayer
from cosyserve.models.speech_lm import AnySpeechLM

logger = logging.getLogger(__name__)

_INT8_MAX = 127
# aten._weight_int8pack_mm on CPU reads K in blocks of 16: other widths crash or go wrong.
_INT8PACK_K_MULTIPLE = 16
_INT4_GROUP_SIZES = (128, 64, 32)

QuantizeDynamic = Callable[..., nn.Module]
M = TypeVar("M", bound=nn.Module)


def quantize_lm_(
    lm: AnySpeechLM, precision: Precision, *, native: Cpu | None = None, onednn: bool = False
) -> None:
    """Quantize ``lm``'s decoder-layer Linear modules as ``precision`` says (nothing for
    ``none``). On CUDA ``lm`` must already be on its device in ``precision.lm_dtype``.
    Dynamic int8 runs on our kernel on the ``native`` CPU (one with AVX-512 VNNI; None: not
    at all) and calls of several rows on oneDNN with ``onednn`` (AMX), each where it loads;
    else on fbgemm.

    Dynamic int8 (CPU) takes the speech head too: its 6564 x 896 float32 weight is read
    whole on every decode step, four times the bytes of its int8 copy, and quantizing it
    adds little to the layers' error (the int8 LM's error against float32:
    ``docs/precision.md``, "What `fast` changes: the tolerances")."""
    mode = precision.quantize
    if mode is Quantization.NONE:
        return
    layers = lm.qwen.layers
    if precision.on_cuda:
        _torchao_(layers, mode)
        return
    quantize_dynamic = ao_quantize_dynamic() if mode is Quantization.INT8 else None
    if mode is Quantization.INT8 and quantize_dynamic is None:
        logger.warning("torch.ao quantize_dynamic is unavailable; int8 uses weight-only int8 instead")
    release = PageReleaser()
    dynamic = quantize_dynamic is not None
    onednn_packer = OneDnnPacker.create() if dynamic and onednn else None
    native_packer = (
        NativeInt8Packer.create(INPUT_SCALE, INPUT_ZERO_POINT, native)
        if dynamic and native is not None
        else None
    )
    for layer in layers:
        weights = [module.weight for module in layer.modules() if isinstance(module, nn.Linear)]
        if quantize_dynamic is None:
            int8_weight_only_(layer)
        else:
            int8_dynamic_([layer], quantize_dynamic, onednn_packer, native_packer)
        # Read once to quantize them: their pages of llm.pt need not stay resident.
        release(weights)
    if quantize_dynamic is not None:
        head = lm.llm_decoder.weight
        # The layers' Linears are int8 already: of the LM's own Linears only the head is left.
        int8_dynamic_([lm], quantize_dynamic, onednn_packer, native_packer)
        release([head])


def ao_quantize_dynamic() -> QuantizeDynamic | None:
    """torch's eager dynamic quantization entry point, or None once torch has removed it."""
    try:
        module = importlib.import_module("torch.ao.quantization")
    except ImportError:
        return None
    function: QuantizeDynamic | None = getattr(module, "quantize_dynamic", None)
    return function


def int8_dynamic_(
    layers: Iterable[nn.Module],
    quantize_dynamic: QuantizeDynamic,
    onednn: OneDnnPacker | None = None,
    native: NativeInt8Packer | None = None,
) -> None:
    """Swap every ``nn.Linear`` of the decoder ``layers`` for torch's dynamic int8 Linear:
    weights int8 per output channel (symmetric), activations quantized per call and row
    (:class:`Int8DynamicLinear`); with ``onednn``, packed for oneDNN too; with ``native``,
    packed for our kernel (:mod:`cosyserve.accel.native_int8`), whose weights then replace
    fbgemm's: every call takes the kernel or oneDNN.

    Each layer's q/k/v and gate/up projections are stacked into one Linear first
    (``fuse_projections_``): a decode step then makes 4 int8 calls per layer instead of 7,
    each stacked call taking about half the time of the calls it replaces (a few percent
    of a whole decode step). With weights per output channel and the same input, the
    stacked call's outputs are the separate calls' exactly.

    In place, one layer at a time, so the float weights (memory-mapped from the
    checkpoint) are never copied whole.
    """
    qconfig_module = importlib.import_module("torch.ao.quantization")
    with warnings.catch_warnings():
        # The deprecation of torch.ao (and of quantized tensors) is known; see the module doc.
        warnings.filterwarnings("ignore", message=r".*deprecated.*")
        qconfig = qconfig_module.per_channel_dynamic_qconfig
        for layer in layers:
            if isinstance(layer, DecoderLayer):
                layer.self_attn.fuse_projections_()
                layer.mlp.fuse_projections_()
            quantize_dynamic(layer, {nn.Linear: qconfig}, dtype=torch.qint8, inplace=True)
            for (parent, name), module in list(_children(layer, _ao_dynamic_linear_type())):
                int8 = Int8DynamicLinear.from_ao(module)
                if native is not None and int8.packed is not None:
                    int8.native = native.pack(int8.packed, int8.bias, int8)
                if onednn is not None and int8.packed is not None:
                    int8.onednn = onednn.pack(int8.packed)
                if int8.native is not None:
                    int8.packed = None  # fbgemm's copy: no call reaches it any more
                setattr(parent, name, int8)


class Int8DynamicLinear(nn.Module):
    """torch's dynamic int8 Linear (fbgemm's int8 GEMM on packed int8 weights per output
    channel, activations quantized per call), called directly and with each input row
    quantized on its own scale.

    The op quantizes its whole input on one scale, the range of all its rows. In a batched
    decode step that put every request's activations on a grid set by the largest among
    them: a request's tokens depended on which requests shared its steps, and a quiet row
    beside loud ones lost precision.
    Here each row is divided by its largest magnitude, so it lies in [-1, 1] and reaches one
    end, and every row is rounded on the grid the dynamic op picks for exactly that range
    (7 bits: scale 2/127, zero point 64), given to fbgemm's op with fixed input parameters
    (``linear_with_input_q_dq_qweight_dq_output_fp32``). The int8 products are exact
    integers, and each output row is scaled back by its own factor before the bias is
    added: a row's output is bit-identical alone and in any batch. (A constant row holding
    -1 and 1, sent with the rows, would set the same range for one more row per call:
    about 15 % more time for a lone decode row's layers.) This costs four small ops per
    call (abs, max, clamp, divide) and the scaling back, where our kernel (:attr:`native`)
    does it all in one op, with the same bits. The ao module's
    ``forward`` is skipped: it reaches its packed weights through a submodule and re-checks
    their dtype on every call (6 % of a batch-1 step).
    """

    bias: torch.Tensor | None

    def __init__(
        self, packed: torch.ScriptObject, in_features: int, out_features: int, bias: torch.Tensor | None
    ) -> None:
        """``packed``: int8 weights packed without a bias; ``bias``: (out,) float32 or None."""
        super().__init__()
        if in_features < 2:
            raise ValueError("an int8 dynamic Linear needs at least 2 input features")
        self.packed: torch.ScriptObject | None = packed
        # The same weights for oneDNN, for calls of several rows, and for our kernel, for
        # every other call (both set by int8_dynamic_; with the kernel, packed goes).
        self.onednn: OneDnnInt8Weight | None = None
        self.native: NativeInt8Weight | None = None
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("bias", bias, persistent=False)

    @classmethod
    def from_ao(cls, module: nn.Module) -> "Int8DynamicLinear":
        """The int8 weights of a qint8 ``torch.ao.nn.quantized.dynamic.Linear``: its packed
        weights shared, or packed again without the bias when it has one."""
        ao: Any = module  # torch.ao's quantized modules carry no type information
        if ao._packed_params.dtype != torch.qint8:
            raise ValueError(f"expected qint8 packed weights, got {ao._packed_params.dtype}")
        packed = ao._packed_params._packed_params
        weight, bias = torch.ops.quantized.linear_unpack(packed)
        if bias is not None:
            packed = torch.ops.quantized.linear_prepack(weight, None)
            bias = bias.detach().float()
        return cls(packed, int(ao.in_features), int(ao.out_features), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (..., in) float32 -> (..., out) float32; quantized to 7 bits as ``torch.ao``
        does on x86 (``reduce_range``), each row on its own scale. Calls of several rows go
        to oneDNN where :attr:`onednn` is set (:mod:`cosyserve.accel.onednn_int8`), the
        others to our kernel where :attr:`native` is set (the same bits, in one op)."""
        rows = x.reshape(-1, self.in_features)  # (M, in)
        native, onednn = self.native, self.onednn
        if native is not None and (onednn is None or rows.shape[0] < onednn.min_rows):
            result: torch.Tensor = native(rows)
            return result.view(*x.shape[:-1], self.out_features)
        # Each row's largest magnitude (a zero row stays zero); dividing by it gives exactly
        # +-1 where it is reached and no magnitude above 1 elsewhere. abs().amax() is the
        # inf-norm, exactly, and several times faster than linalg.vector_norm's reduction
        # here, which took a noticeable share of a prefill.
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)
        scaled = rows / scale
        if onednn is not None and rows.shape[0] >= onednn.min_rows:
            y = onednn(scaled)  # the same bits as fbgemm's below
        elif self.packed is None:
            raise RuntimeError("an int8 Linear without fbgemm's weights got a call its kernel does not take")
        else:
            # The overload itself: the op packet's call first looks for script objects in
            # the arguments in Python, about 1 % of a batch-1 decode step.
            y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default(
                scaled, INPUT_SCALE, INPUT_ZERO_POINT, self.packed
            )  # (M, out)
        # y is the op's own new tensor: scaling it in place spares a pass over fresh memory.
        out = y.mul_(scale) if self.bias is None else torch.addcmul(self.bias, y, scale)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 dynamic per row"


def _ao_dynamic_linear_type() -> type[nn.Module]:
    module_type: type[nn.Module] = importlib.import_module("torch.ao.nn.quantized.dynamic").Linear
    return module_type


class Int8WeightOnlyLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored as int8 rows and one scale per row
    (``scale = max|W_row| / 127``). Computes in bfloat16, returns ``x``'s dtype.

    ``weight``: (out, in) int8; ``scales``: (out,) bfloat16; ``bias``: (out,) or None.
    """

    weight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != torch.int8 or weight.dim() != 2 or scales.shape != weight.shape[:1]:
            raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} and scales {tuple(scales.shape)}")
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8WeightOnlyLinear":
        _check_int8pack_width(linear)
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / _INT8_MAX
        quantized = torch.round(weight / scales[:, None]).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
        return cls(quantized, scales, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (..., in) -> (..., out) in ``x``'s dtype."""
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # (N, in)
        packed: torch.Tensor = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)
        y = packed.to(x.dtype)  # (N, out)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight-only"


def int8_weight_only_(module: nn.Module) -> None:
    """Replace every ``nn.Linear`` under ``module`` by an :class:`Int8WeightOnlyLinear`,
    one at a time (each float weight is dropped as soon as its int8 copy exists)."""
    targets = list(_linears(module))
    for _, linear in targets:  # check all before changing any
        _check_int8pack_width(linear)
    for (parent, name), linear in targets:
        setattr(parent, name, Int8WeightOnlyLinear.from_linear(linear))


class Fp16WeightLinear(nn.Module):
    """A Linear with float16 weights, float32 input, output and accumulation
    (``torch.ops.quantized.linear_dynamic_fp16`` on fbgemm's packed weights). Rounding the
    weights to float16 (11 significant bits) is the only change to the results."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (..., in) float32 -> (..., out) float32."""
        y: torch.Tensor = torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp16 weights"


def fp16_weights_(module: nn.Module) -> None:
    """Replace every ``nn.Linear`` under ``module`` (float32, on the CPU) by an
    :class:`Fp16WeightLinear`, one at a time. The float32 weights are dropped
    (memory-mapped ones are no longer read, and their pages are released), the packed copies
    are private memory of half their size."""
    release = PageReleaser()
    for (parent, name), linear in list(_linears(module)):
        setattr(parent, name, Fp16WeightLinear(linear))
        release([linear.weight])


def _check_int8pack_width(linear: nn.Linear) -> None:
    if linear.in_features % _INT8PACK_K_MULTIPLE:
        raise PrecisionError(
            f"int8 weight-only needs Linear input widths divisible by {_INT8PACK_K_MULTIPLE}, "
            f"got {linear.in_features}; use --quantize int8 or none"
        )


def int4_group_size(module: nn.Module) -> int:
    """The largest torchao int4 group size dividing every Linear input width under ``module``."""
    widths = {linear.in_features for _, linear in _linears(module)}
    for size in _INT4_GROUP_SIZES:
        if all(width % size == 0 for width in widths):
            return size
    raise PrecisionError(f"int4 needs Linear input widths divisible by 32, got {sorted(widths)}")


def _torchao_(module: nn.Module, mode: Quantization) -> None:
    require_torchao()
    api = importlib.import_module("torchao.quantization")
    if mode is Quantization.INT4:
        # tile_packed_to_4d is torch's own tinygemm kernel: no extra kernel package needed.
        config = api.Int4WeightOnlyConfig(
            group_size=int4_group_size(module), int4_packing_format="tile_packed_to_4d"
        )
    else:
        config = api.Int8WeightOnlyConfig()
    api.quantize_(module, config)


def _linears(module: nn.Module) -> Iterator[tuple[tuple[nn.Module, str], nn.Linear]]:
    """Every ``nn.Linear`` under ``module`` with (its parent, its attribute name)."""
    return _children(module, nn.Linear)


def _children(module: nn.Module, kind: type[M]) -> Iterator[tuple[tuple[nn.Module, str], M]]:
    """Every module of type ``kind`` under ``module`` with (its parent, its attribute name)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, kind):
                yield (parent, name), child
