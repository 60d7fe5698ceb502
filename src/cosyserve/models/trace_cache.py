"""Frozen TorchScript traces kept on disk between starts, without the weights they read.

Tracing and freezing the LM's decode steps and the flow estimator's calls took most of a
CPU server's start (full model, 2 cores: about 45 of 75 s), the same work on every start.
A frozen trace holds every tensor and object it read as a constant: saved as it is, a file
would hold a copy of the weights (the flow's five traces, five copies of the estimator),
and a loaded one a second copy in memory. So a trace is saved with those constants turned
into inputs of its graph, each recorded as what it was: a view of a tensor of the traced
module (a parameter, a buffer or a tensor attribute) or of the caller's ``state`` (the KV
cache, scratch buffers), or an object the freezing reached through the module's
attributes (packed int8 and float16 weights), named by its path. A trace from the cache
runs with the live ones as those inputs: the ops of the trace it was saved from, on the
same tensors. The constants left in a file are the few made while tracing (a rotary
table: bytes); a trace that would keep more (MiB), or an object it cannot name, is not
cached.

A file is named by a digest of what decides the graph: the caller's key (the model
directory's fingerprint, the plan with the machine it was made for), torch's version,
this package's files, the trace's name, the shapes, strides and dtypes of its inputs, of the module's
tensors and of ``state``. It is written to a temporary file and renamed, so a start that
reads it while another writes it sees a whole file or none; one that cannot be loaded or
bound is traced again, with a warning, and replaced. Files are small (about 100 KiB) and
stay until removed (``cache_dir()/traces``).
"""

import hashlib
import json
import logging
import os
import platform
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from cosyserve.models.torchscript import Trace, trace_frozen
from cosyserve.paths import cache_dir

logger = logging.getLogger(__name__)

# The largest file of a trace: its code and the constants it made itself (a copy of
# weights or state would be larger).
_MOST_BYTES = 2 << 20
_BINDINGS = "bindings.json"
# Errors of a file that is not a trace of ours, or whose bindings no longer resolve.
_UNUSABLE = (RuntimeError, OSError, ValueError, KeyError, AttributeError, TypeError, IndexError)


class _NotCacheable(Exception):
    """A trace whose graph keeps something that cannot be saved without its data."""


@dataclass(frozen=True)
class TraceCache:
    """Frozen traces under ``directory``, for the model and precision ``key`` names (see
    the module docstring); :meth:`create` adds what else decides a trace to the key."""

    directory: Path
    key: str

    @classmethod
    def create(cls, key: str, directory: Path | None = None) -> "TraceCache":
        """A cache in ``directory`` (None: ``cache_dir()/traces``) for ``key``, which must
        name the model's files and the plan (its precision, kernels and machine); torch's
        version and this package's source are added here."""
        root = Path(__file__).parents[1]
        source = hashlib.sha256()
        for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            source.update(f"{path.relative_to(root).as_posix()}\0".encode())
            source.update(path.read_bytes())
        full_key = "\n".join(
            (key, f"torch {torch.__version__}", f"source {source.hexdigest()}", platform.machine())
        )
        return cls(directory if directory is not None else cache_dir() / "traces", full_key)

    def frozen(
        self, name: str, module: nn.Module, inputs: Sequence[Tensor], state: Mapping[str, Tensor]
    ) -> Trace:
        """:func:`trace_frozen` of ``module`` on ``inputs``, from the cache if there; else
        traced now (and cached where it can be). ``state``: the tensors outside ``module``
        that the traced call reads or writes, by name."""
        tensors = dict(_module_tensors(module)) | {f"state.{k}": v for k, v in state.items()}
        digest = self._digest(name, inputs, tensors)
        path = self.directory / f"{name}-{digest[:40]}.pt"
        if path.is_file():
            try:
                return _load(path, digest, module, tensors)
            except _UNUSABLE as exc:
                logger.warning(
                    "trace cache: %s is unusable (%s: %s); tracing again", path, type(exc).__name__, exc
                )
        traced = trace_frozen(module, inputs)
        try:
            _write_atomically(path, _saved(traced, digest, module, tensors))
        except _NotCacheable as exc:
            logger.info("trace cache: %s is not kept: %s", name, exc)
        except (RuntimeError, TypeError, ValueError, OSError) as exc:  # the trace itself is fine
            logger.warning("trace cache: %s is not kept (%s: %s)", path, type(exc).__name__, exc)
        return traced

    def _digest(self, name: str, inputs: Sequence[Tensor], tensors: Mapping[str, Tensor]) -> str:
        lines = [self.key, name, *(_geometry(x) for x in inputs)]
        lines += [f"{k} {_geometry(v)}" for k, v in tensors.items()]
        return hashlib.sha256("\n".join(lines).encode()).hexdigest()


class _Bound:
    """A loaded trace called with its live tensors and objects after the caller's inputs."""

    def __init__(self, function: Trace, live: Sequence[Any]) -> None:
        self.function = function
        self.live = tuple(live)

    def __call__(self, *inputs: Tensor) -> Any:
        return self.function(*inputs, *self.live)


def _saved(
    traced: torch.jit.ScriptModule, digest: str, module: nn.Module, tensors: Mapping[str, Tensor]
) -> bytes:
    """``traced`` as the bytes of a file: its graph with the constants it can name as
    inputs, and their bindings."""
    by_storage = {_storage(t): name for name, t in tensors.items() if t.untyped_storage().nbytes()}
    graph = traced.graph.copy()
    bindings: list[dict[str, Any]] = []
    for node in graph.findAllNodes("prim::Constant"):  # type: ignore[attr-defined]  # not in torch's stubs
        value = node.output().toIValue()
        if isinstance(value, Tensor):
            name = by_storage.get(_storage(value))
            if name is None or tensors[name].dtype != value.dtype:
                continue
            bindings.append(
                {
                    "tensor": name,
                    "offset": value.storage_offset(),
                    "size": [*value.shape],
                    "stride": [*value.stride()],
                }
            )
        elif isinstance(value, torch.ScriptObject):
            path = node.output().debugName()
            try:
                named = path.startswith("self.") and isinstance(_attribute(module, path), torch.ScriptObject)
            except AttributeError:
                named = False
            if not named:
                raise _NotCacheable(f"it holds an object that is no attribute of the module ({path})")
            bindings.append({"object": path})
        else:
            continue
        live = graph.addInput()
        live.setType(node.output().type())
        node.output().replaceAllUsesWith(live)
        node.destroy()
    if next(iter(graph.inputs())).uses():
        raise _NotCacheable("its graph reads the module")
    graph.eraseInput(0)  # the module itself, read no more
    function = torch._C._create_function_from_graph("forward", graph)
    extra = {_BINDINGS: json.dumps({"digest": digest, "bindings": bindings}).encode()}
    data: bytes = function.save_to_buffer(extra)
    if len(data) > _MOST_BYTES:
        raise _NotCacheable(f"it would keep {len(data)} bytes of tensors that are not the model's")
    return data


def _load(path: Path, digest: str, module: nn.Module, tensors: Mapping[str, Tensor]) -> _Bound:
    """The trace in ``path``, bound to ``module``'s and ``tensors``' live values."""
    extra = {_BINDINGS: ""}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*torch\.jit.*")
        function = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)  # type: ignore[no-untyped-call]
    saved = json.loads(extra[_BINDINGS])
    if saved["digest"] != digest:
        raise ValueError("the file is another trace's")
    live = [_live(binding, module, tensors) for binding in saved["bindings"]]
    return _Bound(function, live)


def _live(binding: Mapping[str, Any], module: nn.Module, tensors: Mapping[str, Tensor]) -> Any:
    if "object" in binding:
        value = _attribute(module, binding["object"])
        if not isinstance(value, torch.ScriptObject):
            raise TypeError(f"{binding['object']} is not an object")
        return value
    base = tensors[binding["tensor"]]
    return base.as_strided(binding["size"], binding["stride"], binding["offset"])


def _attribute(module: nn.Module, path: str) -> Any:
    """The attribute at ``self.a.b`` of ``module``."""
    value: Any = module
    for part in path.split(".")[1:]:
        value = getattr(value, part)
    return value


def _module_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of ``module`` and its submodules: parameters, buffers and tensor
    attributes, by path."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, value in vars(sub).items():
            if isinstance(value, Tensor):
                yield f"{prefix}.{attr}" if prefix else attr, value
        for attr, value in (*sub._parameters.items(), *sub._buffers.items()):
            if value is not None:
                yield f"{prefix}.{attr}" if prefix else attr, value


def _storage(tensor: Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _geometry(tensor: Tensor) -> str:
    return f"{tensor.dtype} {tuple(tensor.shape)} {tensor.stride()} {tensor.device}"


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
