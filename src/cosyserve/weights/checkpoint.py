"""Read official ``.pt`` checkpoints into our modules through explicit, checked tables.

A :class:`CheckpointTable` lists every checkpoint key and the state-dict key of our
module that receives it. Loading checks the table against the file (missing, unexpected
and mis-shaped tensors are errors naming the file, the key and both shapes) and against
the module (every parameter and buffer filled exactly once). Weight-normalised
convolutions are accepted in both storage forms and folded into plain weights.
"""

import pickle
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cosyserve.errors import CheckpointError
from cosyserve.memory import PageReleaser

_WN_FORMS = (
    (".weight_g", ".weight_v"),
    (".parametrizations.weight.original0", ".parametrizations.weight.original1"),
)


@dataclass(frozen=True)
class CheckpointTable:
    """The checked mapping between one checkpoint file and one of our modules.

    ``entries``: (checkpoint key, module key) pairs, in checkpoint naming after weight-norm
    folding (``conv.weight``, not ``conv.weight_g``).
    ``weight_norm``: checkpoint keys (folded names) that the file stores weight-normalised.
    ``aliases``: (checkpoint key, source checkpoint key) for tensors the file carries but we
    do not use because they are tied to another (for example Qwen2's ``lm_head``); they are
    written as the same tensor and accepted, not required, when reading.
    ``strip_prefix``: a prefix removed from every key when present (``generator.`` in hift.pt).
    ``unfolded``: stems (``conv`` for ``conv.weight``) of weight-normalised tensors kept as
    their (g, v) pair instead of folded, for a module that makes the weight itself (in
    float64, say); their entries name the ``parametrizations`` form
    (``conv.parametrizations.weight.original0`` / ``original1``), to which the older
    ``weight_g`` / ``weight_v`` form is renamed when read.
    """

    file: str
    entries: tuple[tuple[str, str], ...]
    weight_norm: frozenset[str] = frozenset()
    aliases: tuple[tuple[str, str], ...] = ()
    strip_prefix: str = ""
    unfolded: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        ckpt_keys = [c for c, _ in self.entries]
        module_keys = [m for _, m in self.entries]
        if len(set(ckpt_keys)) != len(ckpt_keys) or len(set(module_keys)) != len(module_keys):
            raise ValueError(f"{self.file}: checkpoint table maps a key twice")
        unknown = self.weight_norm - set(ckpt_keys)
        if unknown:
            raise ValueError(f"{self.file}: weight_norm names keys outside the table: {sorted(unknown)}")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Load a ``.pt`` state dict memory-mapped, as plain tensors, with clear errors.

    Raises :class:`CheckpointError` for a missing, truncated, corrupt or non-state-dict file.
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint file not found")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        reason = "truncated or corrupt" if not isinstance(exc, pickle.UnpicklingError) else "not loadable"
        raise CheckpointError(f"{path}: checkpoint is {reason} ({exc.__class__.__name__})") from None
    if not isinstance(data, Mapping) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()
    ):
        raise CheckpointError(f"{path}: not a state dict of named tensors")
    return dict(data)


def fold_weight_norm(
    state: Mapping[str, torch.Tensor], keep: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """Replace each (g, v) weight-norm pair, in either storage form, by ``weight = g * v / ||v||``.

    The norm runs over every dimension except the one along which ``g`` varies (dim 0 for
    torch's default, so the norm of each output channel of a convolution). Pairs whose stem
    is in ``keep`` stay pairs, in the ``parametrizations`` form.
    """
    out = dict(state)
    release = PageReleaser()
    for g_suffix, v_suffix in _WN_FORMS:
        for key in [k for k in state if k.endswith(g_suffix)]:
            stem = key[: -len(g_suffix)]
            v_key = stem + v_suffix
            if v_key not in state:
                continue
            if stem in keep:
                kept_g, kept_v = _WN_FORMS[1]
                out[stem + kept_g], out[stem + kept_v] = out.pop(key), out.pop(v_key)
                continue
            g, v = out.pop(key), out.pop(v_key)
            out[stem + ".weight"] = _fold(g, v)
            release([g, v])  # read once; memory-mapped pages need not stay resident
    return out


def _fold(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    varying = [d for d, n in enumerate(g.shape) if n != 1]
    dim = varying[0] if varying else 0
    norm_dims = [d for d in range(v.dim()) if d != dim]
    folded: torch.Tensor = g * v / v.norm(dim=norm_dims, keepdim=True)
    return folded.contiguous()


def unfold_weight_norm(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a plain weight into (g, v) of torch's weight norm along dim 0 (inverse of folding)."""
    dims = list(range(1, weight.dim()))
    return weight.norm(dim=dims, keepdim=True), weight.clone()


def load_checkpoint(module: nn.Module, path: Path, table: CheckpointTable) -> None:
    """Fill ``module`` from the checkpoint at ``path`` through ``table``, checking everything.

    Tensors are assigned, not copied, so the memory-mapped file backs the parameters.
    A tensor converted to the module's dtype is read once: its pages of the file are then
    released (:func:`~cosyserve.memory.release_pages`), so that loading in another dtype
    never holds the whole float32 file resident.
    """
    state = read_state_dict(path)
    if table.strip_prefix:
        state = {k.removeprefix(table.strip_prefix): v for k, v in state.items()}
    state = fold_weight_norm(state, keep=table.unfolded)
    expected = dict(table.entries)
    alias_keys = {a for a, _ in table.aliases}
    unexpected = sorted(set(state) - set(expected) - alias_keys)
    missing = sorted(set(expected) - set(state))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s), first: {missing[0]!r}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s), first: {unexpected[0]!r}")
        raise CheckpointError(f"{path}: {'; '.join(parts)}")
    own = module.state_dict()
    _check_covers(own.keys(), expected.values(), table.file)
    mapped: dict[str, torch.Tensor] = {}
    release = PageReleaser()
    for ckpt_key, module_key in table.entries:
        tensor, target = state[ckpt_key], own[module_key]
        if tensor.shape != target.shape:
            raise CheckpointError(
                f"{path}: tensor {ckpt_key!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
            )
        mapped[module_key] = tensor.to(target.dtype)
        if mapped[module_key].data_ptr() != tensor.data_ptr():
            # Converted: the file's pages of the original are not needed again.
            release([tensor])
    module.load_state_dict(mapped, strict=True, assign=True)


def _check_covers(own: Iterable[str], mapped: Iterable[str], file: str) -> None:
    own_set, mapped_set = set(own), set(mapped)
    if own_set != mapped_set:
        # A table that disagrees with the module is our bug, not the user's file.
        raise RuntimeError(
            f"{file} table and module disagree: unmapped {sorted(own_set - mapped_set)[:3]}, "
            f"unknown {sorted(mapped_set - own_set)[:3]}"
        )


def to_checkpoint(module: nn.Module, table: CheckpointTable) -> dict[str, torch.Tensor]:
    """The official state dict for ``module``: our keys renamed, weight norm in the
    ``parametrizations`` storage form, aliases sharing their source tensor."""
    own = module.state_dict()
    _check_covers(own.keys(), (m for _, m in table.entries), table.file)
    out: dict[str, torch.Tensor] = {}
    for ckpt_key, module_key in table.entries:
        tensor = own[module_key].detach().contiguous()
        if ckpt_key in table.weight_norm:
            g, v = unfold_weight_norm(tensor)
            stem = ckpt_key.removesuffix(".weight")
            out[stem + ".parametrizations.weight.original0"] = g
            out[stem + ".parametrizations.weight.original1"] = v
        else:
            out[ckpt_key] = tensor
    for alias, source in table.aliases:
        out[alias] = out[source]
    return out
