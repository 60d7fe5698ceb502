"""The LM's dynamic int8 Linears on a kernel of our own (``native/int8_rows.cpp``), for CPUs
with AVX-512 VNNI, compiled on first use.

A batch-1 decode step reads the LM's 357 MB of int8 weights once: it is those reads. fbgemm
reads a weight for one row at about half the memory bandwidth; its kernels are made for
matrices, not for one row. So the kernel here streams each weight once per call in VNNI
order (16 output rows x 4 inputs per 64 bytes) with one multiply-add per 64 bytes, and
takes about three quarters of fbgemm's time for one row and for batches alike
(``docs/performance.md``, "Physical limits").

It computes fbgemm's bits: each row scaled and quantized as :class:`Int8DynamicLinear`
quantizes it, exact int32 sums, and the scaling back in fbgemm's and torch's order (the
source says how). Every weight shape is checked against fbgemm on this machine before it
is used (:meth:`NativeInt8Packer.pack`), so a row's output does not depend on which kernel
its call took, and the fbgemm copy of a checked weight can go.

The kernel is compiled with torch's C++ extension builder (``ninja`` and a C++ compiler,
about 10 s once; the build is cached under ``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``, in a directory per installed source file). Where the CPU
lacks the instructions (the plan's ``native_int8`` is off) or the build fails, fbgemm runs
every call.
"""

import functools
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from cosyserve.accel.machine import Cpu

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "int8_rows.cpp"
_LANES = 16  # output rows per block of the packed weight
_CFLAGS = (
    "-O3",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512vnni",
    "-mfma",
    # Every rounding is written out: no multiply-add may be fused where fbgemm has none.
    "-ffp-contract=off",
    # at::parallel_for's OpenMP pragmas: without it the kernel runs on one thread.
    "-fopenmp",
)


@functools.cache
def load(cpu: Cpu) -> bool:
    """Build (or take from the cache) and load the kernel, once per process, where ``cpu``
    runs it (AVX-512 VNNI: elsewhere loading the library would stop the process with an
    illegal instruction); whether ``torch.ops.cosyserve.int8_rows`` can be called. A failed
    build is logged once, with what to do, and fbgemm stays."""
    if not cpu.vnni:
        return False
    from torch.utils import cpp_extension  # imports setuptools: only where it is used

    if shutil.which("ninja") is None:
        _put_ninja_on_path()
    # A build directory per installed source file: two installs on one machine (a server's
    # and a checkout's tests) would otherwise rebuild each other's library at every start.
    where = hashlib.sha256(str(SOURCE).encode()).hexdigest()[:12]
    build = Path(cpp_extension.get_default_build_root()) / f"cosyserve_int8_rows-{where}"
    try:
        build.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(
            name="cosyserve_int8_rows",
            sources=[str(SOURCE)],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError, ValueError, subprocess.SubprocessError) as exc:
        logger.warning(
            "the int8 kernel could not be built (%s: %s); fbgemm runs the LM's int8 Linears. "
            "Install a C++ compiler (g++) to build it",
            type(exc).__name__,
            str(exc).splitlines()[0][:200] if str(exc) else "",
        )
        return False
    return True


def _put_ninja_on_path() -> None:
    """The ``ninja`` wheel's binary on PATH: torch's builder calls ``ninja`` by name, and a
    server started as ``.venv/bin/cosyserve`` has no activated environment."""
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


class NativeInt8Weight(nn.Module):
    """One int8 Linear's weights (symmetric, one scale per output row) packed for the
    kernel, with what its scaling back needs, all padded to whole blocks of 16 rows.

    Buffers: ``weight`` (blocks, in/4, 16, 4) int8; ``col_offsets`` (blocks x 16,) int32,
    each row's sum; ``multipliers`` (blocks x 16,) float32, the input grid's scale times
    the row's; ``bias`` (blocks x 16,) float32 or None."""

    weight: torch.Tensor
    col_offsets: torch.Tensor
    multipliers: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        input_scale: float,
        zero_point: int,
    ) -> None:
        """``weight``: (out, in) int8; ``scales``: (out,) float32; ``bias``: (out,) or None;
        ``input_scale``, ``zero_point``: the grid every input row is quantized on."""
        super().__init__()
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.input_scale = input_scale
        self.zero_point = zero_point
        padding = -self.out_features % _LANES

        def padded(vector: torch.Tensor) -> torch.Tensor:
            return torch.cat([vector, vector.new_zeros(padding)]).contiguous()

        # fbgemm multiplies its sums by (input scale x row scale), that product in float32.
        multipliers = torch.tensor(input_scale, dtype=torch.float32) * scales.float()
        self.register_buffer(
            "weight", torch.ops.cosyserve.pack_int8_rows(weight.contiguous()), persistent=False
        )
        self.register_buffer("col_offsets", padded(weight.sum(1, dtype=torch.int32)), persistent=False)
        self.register_buffer("multipliers", padded(multipliers), persistent=False)
        self.register_buffer("bias", None if bias is None else padded(bias.float()), persistent=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows``: (M, in) float32 -> (M, out) float32, :class:`Int8DynamicLinear`'s bits."""
        out: torch.Tensor = torch.ops.cosyserve.int8_rows(
            rows,
            self.weight,
            self.col_offsets,
            self.multipliers,
            self.bias,
            self.out_features,
            self.input_scale,
            self.zero_point,
        )
        return out


class NativeInt8Packer:
    """Packs int8 Linears' weights for the kernel as they are quantized, each shape checked
    against fbgemm once. Build it with :meth:`create`."""

    def __init__(self, input_scale: float, zero_point: int) -> None:
        self.input_scale = input_scale
        self.zero_point = zero_point
        self._checked: dict[tuple[int, int, bool], bool] = {}  # (in, out, bias) -> fbgemm's bits

    @classmethod
    def create(cls, input_scale: float, zero_point: int, cpu: Cpu) -> "NativeInt8Packer | None":
        """A packer where the kernel loads on ``cpu`` (:func:`load`); None otherwise."""
        if not load(cpu):
            return None
        return cls(input_scale, zero_point)

    def pack(
        self,
        fbgemm: torch.ScriptObject,
        bias: torch.Tensor | None,
        reference: Callable[[torch.Tensor], torch.Tensor],
    ) -> NativeInt8Weight | None:
        """fbgemm's packed symmetric weight (no bias of its own) and the Linear's ``bias``
        for the kernel, or None where its shape gives other bits here than ``reference``,
        the Linear on fbgemm: compared on calls of 1 to 100 rows of mixed magnitudes."""
        weight, packed_bias = torch.ops.quantized.linear_unpack(fbgemm)
        if packed_bias is not None or weight.qscheme() != torch.per_channel_affine:
            raise ValueError("expected int8 weights per output row without a packed bias")
        if bool(weight.q_per_channel_zero_points().any()):
            raise ValueError("expected symmetric int8 weights")
        native = NativeInt8Weight(
            weight.int_repr(), weight.q_per_channel_scales(), bias, self.input_scale, self.zero_point
        )
        shape = (native.in_features, native.out_features, bias is not None)
        if shape not in self._checked:
            gen = torch.Generator().manual_seed(0)
            rows = [torch.randn(n, native.in_features, generator=gen) for n in (1, 2, 5, 13, 100)]
            self._checked[shape] = all(torch.equal(native(r), reference(r)) for r in rows)
            if not self._checked[shape]:
                logger.warning(
                    "int8 Linears of shape %s stay on fbgemm: the kernel gives other bits", shape[:2]
                )
        return native if self._checked[shape] else None
