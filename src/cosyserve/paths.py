"""Where cosyserve looks for things on disk when the caller does not say.

Only the environment is read, at call time, so a test or a service manager that sets
``COSYSERVE_MODEL_DIR`` is seen without re-importing anything.
"""

import os
from pathlib import Path

from cosyserve.errors import ModelDirError

MODEL_DIR_ENV = "COSYSERVE_MODEL_DIR"
DEFAULT_MODEL_NAME = "CosyVoice2-0.5B"
COSYVOICE3_MODEL_NAME = "Fun-CosyVoice3-0.5B-2512"


def cache_dir() -> Path:
    """cosyserve's cache root: ``$XDG_CACHE_HOME/cosyserve``, else ``~/.cache/cosyserve``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says to ignore a relative value.
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "cosyserve"


def default_model_dir() -> Path:
    """The configured (default) model directory: ``$COSYSERVE_MODEL_DIR`` when set (the
    first of several, which it separates with ``os.pathsep`` for a server of several
    models), else ``<cache_dir>/models/CosyVoice2-0.5B``."""
    configured = os.environ.get(MODEL_DIR_ENV, "").split(os.pathsep)[0]
    if configured:
        return Path(configured).expanduser()
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def cached_model_dir(name: str) -> Path:
    """``<cache_dir>/models/<name>``: where ``download`` puts a model no setting names."""
    return cache_dir() / "models" / name


def require_model_dir(path: Path) -> Path:
    """Return ``path`` if it is a directory; otherwise raise :class:`ModelDirError` saying
    how to get one (the layout itself is checked when the model is loaded)."""
    if path.is_dir():
        return path
    if path.exists():
        raise ModelDirError(f"model directory {path} is not a directory")
    raise ModelDirError(
        f"model directory {path} does not exist; pass --model-dir DIR (or set {MODEL_DIR_ENV}) "
        "to a CosyVoice2-0.5B directory, or create one with random weights with "
        "`cosyserve model init DIR --size full`"
    )
