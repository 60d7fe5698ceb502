"""The profile and precision choices (dtype, quantization) as plain string enums.

They live apart from :mod:`cosyserve.accel.precision` so that the settings and the
command line can offer them without importing torch (``cosyserve --help`` stays fast).
"""

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Profile(StrEnum):
    """What the plan optimises for (:mod:`cosyserve.accel.plan`)."""

    AUTO = "auto"
    FAST = "fast"
    EXACT = "exact"


class Dtype(StrEnum):
    """Floating-point format of the LM and the flow (HiFT stays float32)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch  # deferred: see the module docstring

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]


class Quantization(StrEnum):
    """Weight quantization of the LM's decoder-layer Linear modules (q/k/v/o, gate/up/down).

    ``int8``: on CPU, int8 weights with int8 activations quantized per call (fastest);
    ``int8wo``: int8 weights only, activations unquantized (robust to activation
    outliers, slower at large batch); both are weight-only int8 on CUDA. ``int4``:
    grouped int4 weights, CUDA only (torchao, the ``cuda`` extra).
    """

    NONE = "none"
    INT8 = "int8"
    INT8_WEIGHT_ONLY = "int8wo"
    INT4 = "int4"


class FlowQuantization(StrEnum):
    """Storage of the flow estimator's Linear weights (the flow's other modules keep its
    dtype).

    ``fp16``: float16 weights, float32 activations and accumulation (fbgemm, CPU, with the
    float32 flow only). On a CPU without bfloat16 instructions it makes a stream's first
    flow chunk about 1.4x faster and halves the estimator's weight memory, at a mel error
    about 100x smaller than bf16's (``docs/precision.md``).
    """

    NONE = "none"
    FP16 = "fp16"


@dataclass(frozen=True)
class Choices:
    """Explicit precision choices (flags, settings); None leaves a field to the profile.
    ``compile``: torch.compile the unquantized LM (Python API only; slow start)."""

    dtype: Dtype | str | None = None
    quantize: Quantization | str | None = None
    flow_quantize: FlowQuantization | str | None = None
    device: str | None = None
    compile: bool = False
