"""Numeric precision of a loaded model: the dtype each module runs in, LM weight
quantization, the device, and optional compilation of the LM decoder stack.

One :class:`Precision` is resolved (and checked against this machine) before anything is
loaded, so an impossible setting fails at once with a :class:`PrecisionError` that says
what to use instead. The per-module policy, measured on the full-size model (numbers in
``docs/precision.md``):

- LM: the requested dtype. With int8 quantization its activations stay float32 (the
  quantized CPU kernels take float32 input); int4 runs on bfloat16 activations (the
  tinygemm kernel takes only those). The text embedding and the speech embedding are
  never quantized: they are lookups. The speech head is quantized only by dynamic int8
  on a CPU, where its float32 weight is a noticeable share of a decode step's reads and
  int8 adds little to the layers' error; elsewhere it stays as loaded.
- Flow: the requested dtype. With ``flow_quantize = fp16`` (CPU, float32 flow) the
  estimator's Linear weights are stored in float16 and computed in float32: the 10 Euler
  steps of a small streaming chunk read every estimator weight each, and fbgemm's
  float16-weight GEMM reads half the bytes at a rounding far below bfloat16's.
- HiFT: always float32. It is 3 % of the model's weights and a small share of the time,
  its STFT/iSTFT and exp-magnitude output need float32, and it writes the waveform
  directly, so rounding there is audible as noise.
- The KV cache follows the LM's activation dtype (:attr:`Precision.kv_cache_dtype`).
- Prompt feature extraction (onnxruntime, kaldi fbank) is outside these modules and
  stays float32 on the CPU.
"""

import importlib
from dataclasses import dataclass
from enum import StrEnum
from types import ModuleType
from typing import TypeVar

import torch

from cosyserve.accel.machine import fbgemm_available

# Defined without torch for the settings and the CLI; re-exported as part of this API.
from cosyserve.accel.precision_choices import Dtype as Dtype
from cosyserve.accel.precision_choices import FlowQuantization as FlowQuantization
from cosyserve.accel.precision_choices import Quantization as Quantization
from cosyserve.errors import CosyserveError

_E = TypeVar("_E", bound=StrEnum)


class PrecisionError(CosyserveError):
    """The requested dtype, quantization, device or compilation cannot run here."""

    code = "unsupported_precision"


@dataclass(frozen=True)
class Precision:
    """How the model's modules are stored and run. Build it with :meth:`resolve`, which
    checks it against this machine; the default is the plain float32 CPU model."""

    dtype: Dtype = Dtype.FP32
    quantize: Quantization = Quantization.NONE
    device: str = "cpu"
    compile: bool = False
    flow_quantize: FlowQuantization = FlowQuantization.NONE

    @classmethod
    def resolve(
        cls,
        dtype: Dtype | str = Dtype.FP32,
        quantize: Quantization | str = Quantization.NONE,
        device: str = "cpu",
        compile: bool = False,
        flow_quantize: FlowQuantization | str = FlowQuantization.NONE,
    ) -> "Precision":
        """Parse and check a setting. Raises :class:`PrecisionError` naming the problem and
        what to use instead (fp16 or int4 on CPU, CUDA without a GPU, int4 without torchao,
        fp16 flow weights with a flow that is not float32 on the CPU)."""
        parsed = cls(
            _parse(Dtype, dtype, "dtype"),
            _parse(Quantization, quantize, "quantize"),
            device,
            compile,
            _parse(FlowQuantization, flow_quantize, "flow_quantize"),
        )
        parsed._check()
        return parsed

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def on_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    @property
    def lm_dtype(self) -> torch.dtype:
        """The dtype of the LM's activations, unquantized weights and embeddings."""
        if self.quantize is Quantization.INT4:
            return torch.bfloat16
        if self.quantize in (Quantization.INT8, Quantization.INT8_WEIGHT_ONLY) and not self.on_cuda:
            return torch.float32
        return self.dtype.torch_dtype

    @property
    def flow_dtype(self) -> torch.dtype:
        return self.dtype.torch_dtype

    @property
    def hift_dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """What the engine's KV cache (``EngineConfig.dtype``) must hold: the LM's activation
        dtype. A wider cache only costs memory; a narrower one rounds every key and value."""
        return self.lm_dtype

    def describe(self) -> str:
        """One line for logs: ``bf16/int8 on cpu (lm float32, flow bfloat16, hift float32)``;
        fp16 flow weights read ``flow float32 with fp16 weights``."""
        names = [str(d).removeprefix("torch.") for d in (self.lm_dtype, self.flow_dtype, self.hift_dtype)]
        compiled = ", compiled" if self.compile else ""
        weights = "" if self.flow_quantize is FlowQuantization.NONE else f" with {self.flow_quantize} weights"
        return (
            f"{self.dtype}/{self.quantize} on {self.device} "
            f"(lm {names[0]}, flow {names[1]}{weights}, hift {names[2]}{compiled})"
        )

    def _check(self) -> None:
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise PrecisionError(f"unknown device {self.device!r}; use 'cpu' or 'cuda[:N]'") from None
        if device.type not in ("cpu", "cuda"):
            raise PrecisionError(f"device {self.device!r} is not supported; use 'cpu' or 'cuda[:N]'")
        if self.compile and self.quantize is not Quantization.NONE:
            raise PrecisionError("compile applies to the unquantized LM; use --quantize none or no compile")
        if self.flow_quantize is FlowQuantization.FP16:
            self._check_flow_fp16(device)
        if device.type == "cuda":
            self._check_cuda(device)
            return
        if self.dtype is Dtype.FP16:
            raise PrecisionError(
                "fp16 needs a CUDA device (CPU half-precision matmuls are slow and overflow-prone); "
                "on CPU use --dtype bf16 or fp32"
            )
        if self.quantize is Quantization.INT4:
            raise PrecisionError(
                "int4 quantization needs a CUDA device (there is no fast CPU int4 kernel); "
                "on CPU use --quantize int8"
            )

    def _check_flow_fp16(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise PrecisionError(
                "flow_quantize fp16 is a CPU setting; on CUDA use --dtype fp16 and --flow-quantize none"
            )
        if self.flow_dtype != torch.float32:
            raise PrecisionError(
                f"flow_quantize fp16 stores the float32 flow's weights, but the flow runs in "
                f"{self.dtype}; use --dtype fp32 or --flow-quantize none"
            )
        if not fbgemm_available():
            raise PrecisionError(
                "flow_quantize fp16 needs torch's fbgemm kernels, which this torch build "
                "lacks (x86 builds have them); use --flow-quantize none"
            )

    def _check_cuda(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise PrecisionError(
                f"device {self.device!r} requested, but CUDA is not available "
                "(CPU-only torch build or no visible GPU); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise PrecisionError(
                f"device {self.device!r} does not exist: {torch.cuda.device_count()} CUDA device(s) visible"
            )
        if torch.bfloat16 in (self.lm_dtype, self.flow_dtype) and not torch.cuda.is_bf16_supported():
            raise PrecisionError(
                f"this GPU has no bfloat16 support, which {self.dtype}/{self.quantize} needs; "
                "use --dtype fp16 without int4"
            )
        if self.quantize is not Quantization.NONE:
            require_torchao()


def require_torchao() -> ModuleType:
    """Import ``torchao`` (CUDA quantization) or raise an actionable :class:`PrecisionError`."""
    try:
        return importlib.import_module("torchao")
    except ImportError:
        raise PrecisionError(
            "CUDA quantization needs torchao, which is not installed: pip install 'cosyserve[cuda]'"
        ) from None


def _parse(kind: type[_E], value: _E | str, what: str) -> _E:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise PrecisionError(f"unknown {what} {value!r}; choose one of: {choices}") from None
