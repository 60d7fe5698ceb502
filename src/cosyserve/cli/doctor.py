"""``cosyserve doctor``: is this machine able to serve, and if not, what to change.

Two halves, so that the judgement is testable without the hardware: :func:`gather`
collects :class:`Facts` (versions, devices, files, ports), and :func:`evaluate` turns
facts and the :class:`Intent` (device, dtype, quantization: the speed plan's, or as
asked) into :class:`Check` results, each OK, WARN or FAIL with advice. Mismatched
versions (a CUDA wheel on a driver too old for it, an FFmpeg without an encoder)
otherwise fail only at run time, mid-request.
"""

import logging
import platform
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cosyserve.accel.precision_choices import Choices, Profile
from cosyserve.errors import CosyserveError
from cosyserve.modeldir.layout import MANIFEST_FILE, ModelDir
from cosyserve.modeldir.manifest import check_manifest
from cosyserve.modeldir.preflight import download_command

if TYPE_CHECKING:
    from cosyserve.accel.machine import Machine
    from cosyserve.accel.plan import Plan

logger = logging.getLogger(__name__)

TESTED_TORCH = "2.13.0"
MIN_PYTHON = (3, 11)
GIB = 1 << 30
# fp32 sizes of llm.pt, flow.pt and hift.pt in the official snapshot, used for the memory
# estimate when the model directory is not there yet.
OFFICIAL_WEIGHTS = (2_023_000_000, 450_000_000, 83_400_000)
# The files cosyserve fetches (download's default selection), for the disk check.
DOWNLOAD_BYTES = 3_300_000_000
# Share of the LM's weights in its decoder-layer Linear modules (what quantization
# shrinks): 358M of Qwen2.5-0.5B's 494M plus the speech embedding and head.
_QUANTIZABLE_LM_SHARE = 0.7
# CUDA context, KV cache at the default limits, activations and allocator slack.
_GPU_OVERHEAD = int(1.5 * GIB)
_WIDTH = {"fp32": 1.0, "bf16": 0.5, "fp16": 0.5}
_QUANT_WIDTH = {"int8": 0.25, "int8wo": 0.25, "int4": 0.125}
_MIN_FREE_DISK = GIB
_SMI_TIMEOUT_S = 10


class Status(StrEnum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    advice: str = ""


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class Intent:
    """How the server is meant to run: ``device`` auto|cpu|cuda, ``dtype`` fp32|bf16|fp16,
    ``quantize`` none|int8|int8wo|int4."""

    device: str = "auto"
    dtype: str = "fp32"
    quantize: str = "none"


@dataclass(frozen=True)
class Facts:
    """What :func:`gather` found. None: not installed / not known.

    ``torch_cuda``: the CUDA version torch was built for (None: a CPU build).
    ``cpu_bf16``: the CPU has bfloat16 matrix instructions (AVX512-BF16 or AMX).
    ``driver_cuda``: the newest CUDA the installed NVIDIA driver supports.
    ``cuda_error``: why a CUDA build of torch sees no device.
    ``unusable_formats``: response formats whose encoder fails here.
    ``model_error``: what is wrong with the model directory; ``model_warning`` what is
    doubtful; ``model_hashed``: whether file contents were checked, not only names;
    ``weights_bytes``: sizes of llm.pt, flow.pt and hift.pt.
    ``ports``: (label, host, port, error or None) for each port the server would bind.
    ``plan``: the speed plan ``serve`` would run here (:meth:`cosyserve.accel.plan.Plan.describe`),
    or ``plan_error``: why it cannot run (None, None: not asked).
    """

    python: tuple[int, int, int]
    system: str
    platform: str
    torch_version: str | None
    torch_cuda: str | None
    cpu_bf16: bool
    gpus: tuple[Gpu, ...]
    cuda_error: str | None
    driver_version: str | None
    driver_cuda: str | None
    onnxruntime_version: str | None
    onnxruntime_providers: tuple[str, ...]
    av_version: str | None
    unusable_formats: tuple[str, ...]
    wetext_error: str | None
    model_dir: Path
    model_error: str | None
    model_warning: str | None
    model_hashed: bool
    weights_bytes: tuple[int, int, int] | None
    disk_free_bytes: int | None
    ports: tuple[tuple[str, str, int, str | None], ...]
    plan: "Plan | None" = None
    plan_error: str | None = None

    def intent(self, device: str | None, dtype: str | None, quantize: str | None) -> Intent:
        """What the checks judge: each choice as given, else the plan's, else the default."""
        precision = None if self.plan is None else self.plan.precision
        planned = (
            Intent()
            if precision is None
            else Intent("cuda" if precision.on_cuda else "cpu", str(precision.dtype), str(precision.quantize))
        )
        return Intent(device or planned.device, dtype or planned.dtype, quantize or planned.quantize)


def gpu_memory_needed(weights: tuple[int, int, int], plan: Intent) -> int:
    """Rough bytes of GPU memory a server process needs: weights at the planned width
    (HiFT stays float32; quantization shrinks the LM's decoder layers) plus overhead."""
    lm, flow, hift = weights
    width = _WIDTH.get(plan.dtype, 1.0)
    quant = _QUANT_WIDTH.get(plan.quantize, width)
    lm_bytes = lm * ((1 - _QUANTIZABLE_LM_SHARE) * width + _QUANTIZABLE_LM_SHARE * quant)
    return int(lm_bytes + flow * width + hift) + _GPU_OVERHEAD


def evaluate(facts: Facts, plan: Intent) -> list[Check]:
    """Every check, in a fixed order."""
    return [
        *_plan(facts),
        _python(facts),
        _torch(facts),
        _gpu(facts, plan),
        _driver(facts, plan),
        _precision(facts, plan),
        _onnxruntime(facts),
        _codecs(facts),
        _wetext(facts),
        _model(facts),
        _disk(facts),
        *_ports(facts),
    ]


def exit_code(checks: list[Check]) -> int:
    """1 if any check failed, else 0."""
    return 1 if any(c.status is Status.FAIL for c in checks) else 0


def render(checks: list[Check]) -> str:
    """One line per check (status, name, detail), advice indented below it."""
    width = max(len(c.name) for c in checks)
    lines = []
    for check in checks:
        lines.append(f"{check.status.value:<4}  {check.name:<{width}}  {check.detail}")
        if check.advice:
            lines.append(f"{'':<4}  {'':<{width}}  -> {check.advice}")
    return "\n".join(lines)


# -- the checks ---------------------------------------------------------------------------


def _plan(f: Facts) -> list[Check]:
    if f.plan_error is not None:
        return [Check("plan", Status.FAIL, f.plan_error)]
    if f.plan is None:
        return []
    status = Status.WARN if f.plan.warnings else Status.OK
    return [Check("plan", status, f.plan.describe(), "; ".join(f.plan.warnings))]


def _python(f: Facts) -> Check:
    version = ".".join(map(str, f.python))
    detail = f"Python {version} on {f.platform}"
    if f.python[:2] < MIN_PYTHON:
        return Check("python", Status.FAIL, detail, "cosyserve needs Python 3.11 or newer")
    if f.system != "Linux":
        return Check("python", Status.WARN, detail, "cosyserve is tested on Linux only")
    return Check("python", Status.OK, detail)


def _torch(f: Facts) -> Check:
    if f.torch_version is None:
        return Check("torch", Status.FAIL, "not installed", f"pip install torch=={TESTED_TORCH}")
    build = f"CUDA {f.torch_cuda} build" if f.torch_cuda else "CPU build"
    detail = f"{f.torch_version} ({build})"
    if f.torch_version.split("+")[0] != TESTED_TORCH:
        return Check(
            "torch", Status.WARN, detail, f"cosyserve is tested with torch {TESTED_TORCH}; others may fail"
        )
    return Check("torch", Status.OK, detail)


def _gpu(f: Facts, plan: Intent) -> Check:
    if f.gpus:
        first = f.gpus[0]
        count = f"{len(f.gpus)} x " if len(f.gpus) > 1 else ""
        detail = (
            f"{count}{first.name} (compute {first.capability[0]}.{first.capability[1]}, "
            f"{first.total_bytes / GIB:.0f} GiB)"
        )
        if plan.device == "cpu":
            return Check("gpu", Status.OK, f"{detail}; not used (device cpu)")
        return Check("gpu", Status.OK, detail)
    if plan.device == "cpu":
        return Check("gpu", Status.OK, "no CUDA device; not needed (device cpu)")
    detail = "no CUDA device" + (f" ({f.cuda_error})" if f.cuda_error else "")
    if f.driver_version is not None and not f.torch_cuda:
        advice = (
            f"an NVIDIA driver (CUDA {f.driver_cuda}) is installed but torch is a CPU build: "
            f"install the CUDA build of torch {TESTED_TORCH}"
        )
    elif f.torch_cuda and f.driver_version is None:
        advice = "install the NVIDIA driver (and, in a container, run it with GPU access)"
    else:
        advice = "fine for development; real-time serving at scale needs a CUDA GPU"
    status = Status.FAIL if plan.device == "cuda" else Status.WARN
    return Check("gpu", status, detail + ("; running on CPU" if status is Status.WARN else ""), advice)


def _driver(f: Facts, plan: Intent) -> Check:
    if f.driver_version is None:
        if f.gpus:
            return Check("driver", Status.WARN, "version unknown (no nvidia-smi)", "put nvidia-smi on PATH")
        return Check("driver", Status.OK, "no NVIDIA driver (none needed on CPU)")
    detail = f"{f.driver_version}, supports CUDA up to {f.driver_cuda or '?'}"
    if not f.torch_cuda or not f.driver_cuda:
        return Check("driver", Status.OK, detail)
    built, supported = _version(f.torch_cuda), _version(f.driver_cuda)
    detail += f"; torch built for CUDA {f.torch_cuda}"
    if built[0] > supported[0]:
        return Check(
            "driver",
            Status.FAIL if plan.device != "cpu" else Status.WARN,
            detail,
            f"CUDA calls fail at run time: upgrade the driver to one for CUDA {f.torch_cuda}, "
            f"or install a torch build for CUDA {supported[0]}.x",
        )
    if built > supported:
        return Check(
            "driver",
            Status.WARN,
            detail,
            "runs through CUDA minor-version compatibility, except kernels compiled from PTX at "
            f"run time; a driver for CUDA {f.torch_cuda} removes the risk",
        )
    return Check("driver", Status.OK, detail)


def _precision(f: Facts, plan: Intent) -> Check:
    on_gpu = bool(f.gpus) and plan.device != "cpu"
    detail = f"{plan.dtype}, quantization {plan.quantize}, on {'cuda' if on_gpu else 'cpu'}"
    if plan.dtype not in _WIDTH or plan.quantize not in ("none", *_QUANT_WIDTH):
        return Check(
            "precision", Status.FAIL, detail, "dtype: fp32|bf16|fp16; quantize: none|int8|int8wo|int4"
        )
    if not on_gpu:
        if plan.dtype == "fp16" or plan.quantize == "int4":
            return Check(
                "precision", Status.FAIL, detail, "fp16 and int4 run on CUDA only; use bf16 or int8 on CPU"
            )
        if plan.dtype == "bf16" and not f.cpu_bf16:
            return Check(
                "precision",
                Status.WARN,
                detail + "; this CPU has no bfloat16 instructions (AVX512-BF16 or AMX)",
                "bf16 matmuls are emulated here, about 100x slower than fp32: use --dtype fp32 "
                "--flow-quantize fp16",
            )
        return Check("precision", Status.OK, detail)
    gpu = max(f.gpus, key=lambda g: g.free_bytes)
    if plan.dtype == "bf16" and gpu.capability < (8, 0):
        return Check(
            "precision", Status.FAIL, detail, f"{gpu.name} has no bf16 (needs compute 8.0+): use fp16"
        )
    needed = gpu_memory_needed(f.weights_bytes or OFFICIAL_WEIGHTS, plan)
    detail += f"; about {needed / GIB:.1f} GiB needed, {gpu.free_bytes / GIB:.1f} GiB free on {gpu.name}"
    if gpu.free_bytes < needed:
        return Check(
            "precision", Status.FAIL, detail, "free GPU memory, or use bf16/fp16 or int8 quantization"
        )
    if gpu.free_bytes < needed * 1.25:
        return Check(
            "precision", Status.WARN, detail, "little headroom: lower max_active or use a smaller dtype"
        )
    return Check("precision", Status.OK, detail)


def _onnxruntime(f: Facts) -> Check:
    if f.onnxruntime_version is None:
        return Check("onnxruntime", Status.FAIL, "not installed", "pip install onnxruntime==1.32.0")
    detail = f"{f.onnxruntime_version}, providers {', '.join(f.onnxruntime_providers) or 'none'}"
    if "CPUExecutionProvider" not in f.onnxruntime_providers:
        return Check(
            "onnxruntime", Status.FAIL, detail, "the prompt feature models need CPUExecutionProvider"
        )
    return Check("onnxruntime", Status.OK, detail)


def _codecs(f: Facts) -> Check:
    if f.av_version is None:
        return Check("audio codecs", Status.FAIL, "PyAV not installed", "pip install av==18.1.0")
    if f.unusable_formats:
        return Check(
            "audio codecs",
            Status.WARN,
            f"PyAV {f.av_version}: no working encoder for {', '.join(f.unusable_formats)}",
            "requests for those response formats will fail; install the PyAV wheel (it bundles FFmpeg)",
        )
    return Check("audio codecs", Status.OK, f"PyAV {f.av_version}: every response format encodes")


def _wetext(f: Facts) -> Check:
    if f.wetext_error is not None:
        return Check(
            "text normalization",
            Status.FAIL,
            f"wetext grammars do not load ({f.wetext_error})",
            "pip install --force-reinstall wetext==0.1.8",
        )
    return Check("text normalization", Status.OK, "wetext zh and en grammars load")


def _model(f: Facts) -> Check:
    if f.model_error is not None:
        return Check("model directory", Status.FAIL, f.model_error, f"`{download_command(f.model_dir)}`")
    if f.model_warning is not None:
        return Check(
            "model directory",
            Status.WARN,
            f.model_warning,
            f"if the files are known good: `cosyserve verify --write {f.model_dir}`",
        )
    checked = "files and sha256" if f.model_hashed else "file names (sha256 not checked)"
    return Check("model directory", Status.OK, f"{f.model_dir}: layout OK, {checked} match {MANIFEST_FILE}")


def _disk(f: Facts) -> Check:
    if f.disk_free_bytes is None:
        return Check("disk", Status.WARN, "free space unknown")
    detail = f"{f.disk_free_bytes / GIB:.1f} GiB free for {f.model_dir}"
    if not f.model_dir.exists() and f.disk_free_bytes < DOWNLOAD_BYTES:
        return Check("disk", Status.FAIL, detail, f"the download needs {DOWNLOAD_BYTES / GIB:.1f} GiB")
    if f.disk_free_bytes < _MIN_FREE_DISK:
        return Check("disk", Status.WARN, detail, "logs, the voice database and the audio cache need room")
    return Check("disk", Status.OK, detail)


def _ports(f: Facts) -> list[Check]:
    checks = []
    for label, host, port, error in f.ports:
        name = f"{label} port"
        if error is None:
            checks.append(Check(name, Status.OK, f"{host}:{port} is free"))
        else:
            checks.append(
                Check(
                    name,
                    Status.FAIL,
                    f"{host}:{port}: {error}",
                    "stop what listens there or choose another port",
                )
            )
    return checks


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


# -- gathering facts ----------------------------------------------------------------------


def gather(
    model_dir: Path,
    host: str,
    ports: list[tuple[str, int]],
    *,
    verify_hashes: bool = True,
    profile: Profile = Profile.AUTO,
    choices: Choices | None = None,
) -> Facts:
    """Look at this machine. ``ports``: (label, port) pairs; port 0 is skipped. The plan is
    ``profile``'s with ``choices``, as ``serve`` would choose it."""
    torch_version, torch_cuda, gpus, cuda_error = _torch_facts()
    driver_version, driver_cuda = _nvidia_smi()
    ort_version, providers = _onnxruntime_facts()
    av_version, unusable = _codec_facts()
    model_error, model_warning, weights = _model_facts(model_dir, verify_hashes)
    machine = _machine()
    plan, plan_error = _plan_facts(machine, profile, choices or Choices(), model_dir)
    return Facts(
        python=(sys.version_info.major, sys.version_info.minor, sys.version_info.micro),
        system=platform.system(),
        platform=platform.platform(),
        torch_version=torch_version,
        torch_cuda=torch_cuda,
        cpu_bf16=machine is not None and machine.cpu.native_bf16,
        gpus=gpus,
        cuda_error=cuda_error,
        driver_version=driver_version,
        driver_cuda=driver_cuda,
        onnxruntime_version=ort_version,
        onnxruntime_providers=providers,
        av_version=av_version,
        unusable_formats=unusable,
        wetext_error=_wetext_error(),
        model_dir=model_dir,
        model_error=model_error,
        model_warning=model_warning,
        model_hashed=verify_hashes,
        weights_bytes=weights,
        disk_free_bytes=_disk_free(model_dir),
        ports=tuple((label, host, port, _port_error(host, port)) for label, port in ports if port),
        plan=plan,
        plan_error=plan_error,
    )


def _torch_facts() -> tuple[str | None, str | None, tuple[Gpu, ...], str | None]:
    try:
        import torch
    except ImportError:
        return None, None, (), None
    cuda: str | None = torch.version.cuda
    if cuda is None:
        return torch.__version__, None, (), None
    try:
        torch.cuda.current_device()  # initialises CUDA; its error says why there is no device
    except (RuntimeError, AssertionError) as exc:
        return torch.__version__, cuda, (), _first_line(exc)
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        gpus.append(Gpu(props.name, (props.major, props.minor), total, free))
    return torch.__version__, cuda, tuple(gpus), None


def _machine() -> "Machine | None":
    try:
        from cosyserve.accel.machine import Machine
    except ImportError:  # no torch: nothing can run, which the torch check reports
        return None
    return Machine.detect()


def _plan_facts(
    machine: "Machine | None", profile: Profile, choices: Choices, model_dir: Path
) -> "tuple[Plan | None, str | None]":
    """The plan as ``serve`` runs it: narrowed to a CosyVoice 3 model's flow where
    ``model_dir`` is one (as loading it does)."""
    if machine is None:
        return None, "no plan without torch"
    from cosyserve.accel.plan import choose_plan
    from cosyserve.modeldir.family import Family
    from cosyserve.modeldir.layout import detect_family

    try:
        plan = choose_plan(machine, profile, choices)
    except CosyserveError as exc:
        return None, str(exc)
    try:
        cosyvoice3 = detect_family(model_dir) is Family.COSYVOICE3
    except (CosyserveError, OSError):  # the model directory's own check says what is wrong
        cosyvoice3 = False
    return (plan.for_cosyvoice3() if cosyvoice3 else plan), None


def _nvidia_smi() -> tuple[str | None, str | None]:
    """(driver version, newest CUDA it supports) from nvidia-smi's header."""
    command = shutil.which("nvidia-smi")
    if command is None:
        return None, None
    try:
        out = subprocess.run([command], capture_output=True, text=True, timeout=_SMI_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    driver = re.search(r"Driver Version:\s*([\d.]+)", out)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", out)
    return (driver.group(1) if driver else None), (cuda.group(1) if cuda else None)


def _onnxruntime_facts() -> tuple[str | None, tuple[str, ...]]:
    try:
        import onnxruntime
    except ImportError:
        return None, ()
    return str(onnxruntime.__version__), tuple(onnxruntime.get_available_providers())


def _codec_facts() -> tuple[str | None, tuple[str, ...]]:
    """PyAV's version and the formats whose encoder fails on one short chunk."""
    try:
        import av
    except ImportError:
        return None, ()
    from cosyserve.audio import SUPPORTED_FORMATS, create_encoder

    unusable = []
    for name in SUPPORTED_FORMATS:
        try:
            encoder = create_encoder(name, 24000, stream=False)
            try:
                encoder.encode(np.zeros(2400, dtype=np.float32))
                encoder.finish()
            finally:
                encoder.close()
        except Exception:  # a probe: whatever FFmpeg raises, the format is unusable here
            logger.debug("encoder probe failed for %s", name, exc_info=True)
            unusable.append(name)
    return str(av.__version__), tuple(unusable)


def _wetext_error() -> str | None:
    try:
        from wetext import Normalizer

        for language in ("zh", "en"):
            Normalizer(lang=language, operator="tn", remove_erhua=False).normalize("2")
    except Exception as exc:  # a probe: missing or broken grammar files raise anything
        return f"{exc.__class__.__name__}: {_first_line(exc)}"
    return None


def _model_facts(
    path: Path, verify_hashes: bool
) -> tuple[str | None, str | None, tuple[int, int, int] | None]:
    if not path.exists():
        return f"{path} does not exist", None, None
    try:
        model = ModelDir.open(path)
    except CosyserveError as exc:
        return str(exc), None, None
    weights = (model.llm.stat().st_size, model.flow.stat().st_size, model.hift.stat().st_size)
    if not (path / MANIFEST_FILE).is_file():
        return None, f"{path} has no {MANIFEST_FILE}: its files cannot be checked", weights
    try:
        problems = check_manifest(path, hashes=verify_hashes)
    except CosyserveError as exc:
        return str(exc), None, weights
    if problems:
        return "; ".join(str(p) for p in problems), None, weights
    return None, None, weights


def _disk_free(path: Path) -> int | None:
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        return shutil.disk_usage(existing).free
    except OSError:
        return None


def _port_error(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As uvicorn binds: a port held only by TIME_WAIT connections is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else exc.__class__.__name__
