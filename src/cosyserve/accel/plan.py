"""The plan: every speed choice of a process, made once from the profile and the machine.

``exact`` is the parity configuration: float32, upstream's streaming schedule, output
identical to upstream's. ``fast`` is the fastest combination measured on this kind of
machine (docs/performance.md), its output within docs/precision.md's tolerances.
``auto`` is ``fast`` where such a measurement exists for the detected hardware (a CUDA
device if there is one), else the safe float32 plan. Explicit choices (``--dtype``,
``--quantize``, ``--flow-quantize``, ``--device``) override one field each; a choice of
the profile that cannot run with them yields to them.

Every optimisation is switched on from a :class:`Plan` only: the loader reads its
precision and kernels, the engine options its capture and flow-cache fields.
"""

from dataclasses import dataclass, replace
from enum import StrEnum

import torch

from cosyserve.accel.flow_cache_mode import FlowCacheDtype, FlowCacheMode
from cosyserve.accel.machine import CpuKind, Machine
from cosyserve.accel.precision import Precision
from cosyserve.accel.precision_choices import Choices, Dtype, FlowQuantization, Profile, Quantization

__all__ = ["Choices", "DecodeCapture", "Plan", "Profile", "choose_plan"]


class DecodeCapture(StrEnum):
    """How LM decode steps are replayed: TorchScript traces on a CPU, CUDA graphs on a GPU,
    or eagerly (a compiled LM, which traces cannot hold)."""

    EAGER = "eager"
    TRACE = "trace"
    CUDA_GRAPHS = "cuda_graphs"


_CPU = "cpu"
_CUDA = "cuda"
# The fastest precision measured per kind of CPU (docs/performance.md has the runs): with
# bfloat16 instructions bf16 + int8; without them bf16 is emulated, so float32 + int8 with
# the flow's weights in float16 (fbgemm's fp16 GEMM reads half the bytes).
_FAST_CPU: dict[CpuKind, tuple[Dtype, Quantization, FlowQuantization]] = {
    CpuKind.AMX: (Dtype.BF16, Quantization.INT8, FlowQuantization.NONE),
    CpuKind.AVX512_BF16: (Dtype.BF16, Quantization.INT8, FlowQuantization.NONE),
    CpuKind.AVX512_VNNI: (Dtype.FP32, Quantization.INT8, FlowQuantization.FP16),
    CpuKind.AVX2: (Dtype.FP32, Quantization.INT8, FlowQuantization.FP16),
}
# On a GPU with bfloat16: bf16, the LM unquantized (docs/performance.md, "On a GPU").
_FAST_CUDA = (Dtype.BF16, Quantization.NONE, FlowQuantization.NONE)
# Tokens in a stream's first chunk under ``fast``: the first audio after 5 + 3 look-ahead
# tokens instead of upstream's 25-50 + 3.
FAST_FIRST_HOP = 5


@dataclass(frozen=True)
class Plan:
    """One process's speed choices.

    ``profile``: the profile asked for; ``basis``: what the choice rests on (for logs);
    ``machine``: what it was chosen for.
    ``native_int8``: the LM's int8 Linears on our AVX-512 VNNI kernel
    (:mod:`cosyserve.accel.native_int8`); ``onednn_int8``: calls of several rows on oneDNN
    (AMX). Both give fbgemm's bits. ``packed_bf16``: the bf16 flow's Linears and
    convolutions packed for oneDNN; ``fused_bf16_attention``: the flow's bf16 attention in
    torch's fused kernel (fast with AMX tiles only; else split GEMMs).
    ``decode_capture``, ``traced_flow``: replay of decode steps and flow steps.
    ``flow_cache``, ``flow_prompt_whole``: streaming flow work (docs/streaming.md);
    ``flow_cache_dtype``: what streams' flow caches are held in (see
    :data:`~cosyserve.accel.flow_cache_mode.FlowCacheDtype`).
    ``first_hop``: default tokens in a stream's first chunk (None: upstream's, aligned to
    the 25-token block); ``hop_growth``: upstream's hop doubling within a request (25, 50,
    100) instead of a constant 25. ``threads``: torch threads of the engine.
    ``warnings``: what this plan runs but should not (an explicit choice that is slow
    here), for whoever loads a model with it.
    """

    profile: Profile
    basis: str
    precision: Precision
    machine: Machine
    native_int8: bool = False
    onednn_int8: bool = False
    packed_bf16: bool = False
    fused_bf16_attention: bool = False
    decode_capture: DecodeCapture = DecodeCapture.TRACE
    traced_flow: bool = True
    flow_cache: FlowCacheMode = "incremental"
    flow_prompt_whole: bool = False
    flow_cache_dtype: FlowCacheDtype = "computed"
    first_hop: int | None = None
    hop_growth: bool = False
    threads: int = 1
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        """The plan in one line, for the start-up log, ``doctor`` and ``/health``."""
        fields = self.labels()
        shown = " ".join(f"{key}={value}" for key, value in fields.items() if key not in ("profile", "basis"))
        return f"profile {self.profile} ({self.basis}): {shown}"

    def for_cosyvoice3(self) -> "Plan":
        """This plan for a CosyVoice 3 model: the LM's choices, the flow's fp16 weights,
        the streaming schedule and primed voice prompts (whole ones too, where the plan
        asks) stay; CosyVoice 2's packed bf16 layers and traced steps do not exist for the
        DiT flow and are off."""
        return replace(
            self,
            packed_bf16=False,
            fused_bf16_attention=False,
            traced_flow=False,
        )

    def labels(self) -> dict[str, str]:
        """Every field as text (the ``cosyserve_plan_info`` metric's labels)."""
        p = self.precision
        return {
            "profile": str(self.profile),
            "basis": self.basis,
            "cpu": str(self.machine.cpu.kind),
            "device": p.device,
            "dtype": str(p.dtype),
            "quantize": str(p.quantize),
            "flow_quantize": str(p.flow_quantize),
            "int8_kernel": self._int8_kernel(),
            "packed_bf16": _yes(self.packed_bf16),
            "fused_bf16_attention": _yes(self.fused_bf16_attention),
            "decode_capture": str(self.decode_capture),
            "traced_flow": _yes(self.traced_flow),
            "flow_cache": self.flow_cache,
            "flow_prompt_whole": _yes(self.flow_prompt_whole),
            "flow_cache_dtype": self.flow_cache_dtype,
            "first_hop": "upstream" if self.first_hop is None else str(self.first_hop),
            "hop_growth": _yes(self.hop_growth),
            "threads": str(self.threads),
        }

    def _int8_kernel(self) -> str:
        if self.precision.quantize is not Quantization.INT8 or self.precision.on_cuda:
            return "none"
        if self.native_int8:
            return "native+onednn" if self.onednn_int8 else "native"
        return "fbgemm+onednn" if self.onednn_int8 else "fbgemm"


def choose_plan(
    machine: Machine,
    profile: Profile | str = Profile.AUTO,
    choices: Choices | None = None,
    threads: int | None = None,
) -> Plan:
    """The plan for ``profile`` on ``machine`` with ``choices`` applied, its engine on
    ``threads`` torch threads (None: this thread's count). Raises
    :class:`~cosyserve.accel.precision.PrecisionError` for a choice this machine cannot run."""
    profile = Profile(profile)
    choices = choices or Choices()
    device = choices.device or (f"{_CUDA}:0" if machine.cuda else _CPU)
    on_cuda = device.split(":")[0] == _CUDA
    measured = _measured(machine, on_cuda)
    if profile is Profile.EXACT:
        basis, fast = "parity with upstream", False
        picked = (Dtype.FP32, Quantization.NONE, FlowQuantization.NONE)
    elif measured is not None:
        kind = "cuda" if on_cuda else machine.cpu.kind
        basis, fast, picked = f"measured on {kind}", True, measured
    elif profile is Profile.FAST:
        basis, fast = f"no measured plan for {machine.cpu.kind}: float32", True
        picked = (Dtype.FP32, Quantization.NONE, FlowQuantization.NONE)
    else:
        basis, fast = f"safe: no measured plan for {machine.cpu.kind}", False
        picked = (Dtype.FP32, Quantization.NONE, FlowQuantization.NONE)
    precision = _precision(picked, choices, device)
    plan = Plan(profile, basis, precision, machine, threads=threads or torch.get_num_threads())
    return _fill(plan, fast)


def _measured(machine: Machine, on_cuda: bool) -> tuple[Dtype, Quantization, FlowQuantization] | None:
    if on_cuda:
        return _FAST_CUDA if machine.cuda and all(d.bf16 for d in machine.cuda) else None
    if not machine.fbgemm:  # int8 and fp16 flow weights run on fbgemm
        return None
    return _FAST_CPU.get(machine.cpu.kind)


def _precision(
    picked: tuple[Dtype, Quantization, FlowQuantization], choices: Choices, device: str
) -> Precision:
    dtype = choices.dtype if choices.dtype is not None else picked[0]
    quantize = choices.quantize if choices.quantize is not None else picked[1]
    flow_quantize = choices.flow_quantize if choices.flow_quantize is not None else picked[2]
    # fp16 flow weights are a float32 CPU flow's: a profile's choice yields to an explicit
    # dtype or device it cannot run with.
    if choices.flow_quantize is None and (Dtype(dtype) is not Dtype.FP32 or device.startswith(_CUDA)):
        flow_quantize = FlowQuantization.NONE
    return Precision.resolve(dtype, quantize, device, choices.compile, flow_quantize)


def _fill(plan: Plan, fast: bool) -> Plan:
    p, machine, profile = plan.precision, plan.machine, plan.profile
    cpu = not p.on_cuda
    int8 = p.quantize is Quantization.INT8 and cpu
    bf16_flow = p.flow_dtype == torch.bfloat16 and cpu
    flow_cache: FlowCacheMode
    if p.on_cuda:
        # A chunk of any width costs about the same on a GPU (launch-bound), and incremental
        # chunks batch only with streams at the same position: ``exact``, whose chunks all
        # go in one batch, serves more streams (docs/performance.md, "On a GPU").
        capture, flow_cache = DecodeCapture.CUDA_GRAPHS, "exact"
    else:
        # ``cached`` gives upstream's output; ``incremental`` also the final chunk from the
        # cache, slightly different, and cheapest.
        capture, flow_cache = DecodeCapture.TRACE, "cached" if profile is Profile.EXACT else "incremental"
    if p.compile:
        capture = DecodeCapture.EAGER
    narrow_caches = fast and cpu and flow_cache != "exact" and p.flow_dtype == torch.float32
    return replace(
        plan,
        native_int8=int8 and machine.cpu.vnni,
        onednn_int8=int8 and machine.cpu.amx,
        packed_bf16=bf16_flow and machine.mkldnn_bf16,
        fused_bf16_attention=bf16_flow and machine.cpu.amx,
        decode_capture=capture,
        traced_flow=cpu and flow_cache != "exact",
        flow_cache=flow_cache,
        flow_prompt_whole=fast and flow_cache != "exact",
        # Streams' caches grow with every frame: a float32 flow holds them in a quarter of
        # the memory, within docs/precision.md's tolerances.
        flow_cache_dtype="int8" if narrow_caches else "computed",
        first_hop=FAST_FIRST_HOP if fast else None,
        hop_growth=profile is Profile.EXACT,
        warnings=_warnings(p, machine),
    )


def _warnings(precision: Precision, machine: Machine) -> tuple[str, ...]:
    if not precision.on_cuda and precision.flow_dtype == torch.bfloat16 and not machine.cpu.native_bf16:
        return (
            "bf16 on a CPU without bfloat16 instructions (AVX512-BF16 or AMX): torch emulates its "
            "matmuls, about 100x slower than fp32; use --dtype fp32 --flow-quantize fp16",
        )
    return ()


def _yes(flag: bool) -> str:
    return "on" if flag else "off"
