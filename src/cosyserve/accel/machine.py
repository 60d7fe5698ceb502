"""What this machine can run: its CPU's instruction sets, its CUDA devices and the kernels
this torch build has. Detected once at start (:meth:`Machine.detect`) and handed to
:func:`cosyserve.accel.plan.choose_plan`; nothing else in cosyserve probes the hardware.
"""

import os
import platform
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch


class CpuKind(StrEnum):
    """The CPU families the plans are measured on, from the instructions that decide them:
    bfloat16 matrix instructions (AMX tiles, or AVX512-BF16), AVX-512 VNNI (our int8
    kernel), AVX2 (fbgemm's int8 and fp16 GEMMs), or none of these."""

    AMX = "amx"
    AVX512_BF16 = "avx512_bf16"
    AVX512_VNNI = "avx512_vnni"
    AVX2 = "avx2"
    OTHER = "other"


@dataclass(frozen=True)
class Cpu:
    """The CPU's name, usable cores and the instruction sets the plans depend on."""

    name: str
    cores: int
    avx2: bool = False
    avx512: bool = False
    vnni: bool = False
    bf16: bool = False
    amx: bool = False

    @property
    def kind(self) -> CpuKind:
        if self.amx:
            return CpuKind.AMX
        if self.bf16:
            return CpuKind.AVX512_BF16
        if self.vnni:
            return CpuKind.AVX512_VNNI
        if self.avx2:
            return CpuKind.AVX2
        return CpuKind.OTHER

    @property
    def native_bf16(self) -> bool:
        """bfloat16 matrix instructions: without them torch emulates bfloat16 GEMMs, about
        100x slower than float32 (docs/precision.md)."""
        return self.bf16 or self.amx


@dataclass(frozen=True)
class CudaDevice:
    index: int
    name: str
    memory_bytes: int
    bf16: bool


@dataclass(frozen=True)
class Machine:
    """``fbgemm``: torch's x86 int8/fp16 GEMMs (int8 LM, fp16 flow weights);
    ``mkldnn_bf16``: oneDNN runs bfloat16 here (packed bfloat16 Linears)."""

    cpu: Cpu
    cuda: tuple[CudaDevice, ...] = ()
    fbgemm: bool = False
    mkldnn_bf16: bool = False

    @classmethod
    def detect(cls) -> "Machine":
        return cls(
            cpu=_detect_cpu(),
            cuda=_detect_cuda(),
            fbgemm=fbgemm_available(),
            mkldnn_bf16=bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        )

    def describe(self) -> str:
        """One line: ``AMD EPYC 7B13, 2 cores (avx2), no CUDA device``."""
        flags = [name for name in ("avx2", "avx512", "vnni", "bf16", "amx") if getattr(self.cpu, name)]
        gpus = ", ".join(f"cuda:{d.index} {d.name} ({d.memory_bytes / 2**30:.0f} GiB)" for d in self.cuda)
        return f"{self.cpu.name}, {self.cpu.cores} cores ({' '.join(flags) or 'no vector flags'}), " + (
            gpus or "no CUDA device"
        )


def fbgemm_available() -> bool:
    """Whether torch has its fbgemm kernels (x86 builds), which int8 LMs and fp16 flow
    weights run on."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, as a container's CPU set limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _detect_cpu() -> Cpu:
    # torch's own probes (cpuinfo), which are what its kernels dispatch on; /proc/cpuinfo
    # only for the name.
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return Cpu(
        name=_cpu_name(),
        cores=usable_cores(),
        avx2=x86 and bool(torch.cpu._is_avx2_supported()),
        avx512=x86 and bool(torch.cpu._is_avx512_supported()),
        vnni=x86 and bool(torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported()),
        bf16=x86 and bool(torch.cpu._is_avx512_bf16_supported()),
        amx=x86 and bool(torch.cpu._is_amx_tile_supported()),
    )


def _cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def _detect_cuda() -> tuple[CudaDevice, ...]:
    if not torch.cuda.is_available():
        return ()
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            CudaDevice(index, props.name, int(props.total_memory), bool(torch.cuda.is_bf16_supported()))
        )
    return tuple(devices)
