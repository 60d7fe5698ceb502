"""Access to upstream CosyVoice (``cosyvoice-minicpmo``), the test-only reference.

Upstream's model modules import ``torchaudio`` (only for file loading, which the model
classes never call) and ``matcha.utils`` (whose package ``__init__`` pulls in hydra and
lightning; the model code needs only ``get_pylogger``). Neither is installed, so this
module registers minimal stand-ins for exactly those two imports before importing
upstream. cosyserve itself never imports upstream.
"""

import importlib.machinery
import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest


def _install_stand_ins() -> None:
    if "torchaudio" not in sys.modules:
        stand_in = types.ModuleType("torchaudio")
        # A spec, so that importlib.util.find_spec (used by transformers) does not fail;
        # with no installed distribution, transformers still reports torchaudio absent.
        stand_in.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
        sys.modules["torchaudio"] = stand_in
    if "matcha.utils" not in sys.modules:
        import matcha  # the real package, from cosyvoice-minicpmo

        utils = types.ModuleType("matcha.utils")
        utils.__path__ = [str(Path(matcha.__file__).parent / "utils")]
        pylogger = types.ModuleType("matcha.utils.pylogger")
        pylogger.get_pylogger = logging.getLogger  # type: ignore[attr-defined]
        utils.pylogger = pylogger  # type: ignore[attr-defined]
        sys.modules["matcha.utils"] = utils
        sys.modules["matcha.utils.pylogger"] = pylogger
        matcha.utils = utils  # type: ignore[attr-defined]  # attribute lookups (hyperpyyaml's !name:)


def upstream(module: str) -> Any:
    """Import an upstream module (e.g. ``cosyvoice.flow.flow``), skipping nothing: a missing
    reference is a failed test, because the parity suite must run in CI."""
    _install_stand_ins()
    return __import__(module, fromlist=["_"])


def load_yaml_sections(
    yaml_text: str, sections: tuple[str, ...], qwen_path: Path | None = None
) -> dict[str, Any]:
    """Instantiate upstream classes for the given top-level yaml sections with hyperpyyaml.

    Only the header (scalars) and the named sections are loaded, so the training-only
    entries (discriminators, data pipeline) are never built.
    """
    _install_stand_ins()
    from hyperpyyaml import load_hyperpyyaml

    blocks: list[str] = []
    current: list[str] = []
    for line in yaml_text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            blocks.append("\n".join(current))
            current = []
        current.append(line)
    blocks.append("\n".join(current))
    keep = []
    for block in blocks:
        key = block.split(":", 1)[0].strip()
        first = block.split("\n", 1)[0]
        is_scalar = "!new:" not in first and "!name:" not in first and "!apply:" not in first
        if key in sections or (is_scalar and key and not key.startswith("#")):
            keep.append(block)
    overrides = {"qwen_pretrain_path": str(qwen_path)} if qwen_path is not None else {}
    return dict(load_hyperpyyaml("\n".join(keep), overrides=overrides))


__all__ = ["load_yaml_sections", "pytest", "upstream"]
