"""Access to upstream CosyVoice 3 for making committed parity fixtures (never used by CI).

The PyPI reference (``cosyvoice-minicpmo``) predates CosyVoice 3, so the fixture makers run
against a checkout of FunAudioLLM/CosyVoice at commit ``ace7c47`` (see
:data:`UPSTREAM_COMMIT`), pointed to by ``COSYVOICE3_UPSTREAM``, with the few pure-Python
packages its CosyVoice 3 modules import and this project does not install
(``x-transformers`` and its dependencies, ``tiktoken``, ``openai-whisper``) in a separate
folder named by ``COSYVOICE3_SITE``::

    pip install --no-deps --target /tmp/upv3-site x-transformers loguru einx frozendict \
        torch_einops_utils tiktoken openai-whisper
    COSYVOICE3_UPSTREAM=/path/to/CosyVoice COSYVOICE3_SITE=/tmp/upv3-site \
        .venv/bin/python -m tests.models.cosyvoice3.make_fixtures

The upstream checkout must come first on ``sys.path``: the installed ``cosyvoice-minicpmo``
has a package of the same name. cosyserve itself never imports upstream.
"""

import importlib
import importlib.machinery
import os
import sys
import types
from typing import Any

UPSTREAM_COMMIT = "ace7c47"


def _stand_in(name: str, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    sys.modules[name] = module
    return module


def _prepare() -> None:
    root = os.environ.get("COSYVOICE3_UPSTREAM")
    site = os.environ.get("COSYVOICE3_SITE")
    if not root or not site:
        raise SystemExit("set COSYVOICE3_UPSTREAM (the checkout) and COSYVOICE3_SITE (its packages)")
    for path in (site, root):
        if path not in sys.path:
            sys.path.insert(0, path)
    loaded = sys.modules.get("cosyvoice")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(root):
        raise SystemExit("cosyvoice-minicpmo was imported first; run the fixture maker in its own process")
    if "torchaudio" not in sys.modules:
        # Imported at module level for file loading and online features, never called here.
        audio = _stand_in("torchaudio", package=True)
        compliance = _stand_in("torchaudio.compliance", package=True)
        kaldi = _stand_in("torchaudio.compliance.kaldi")
        audio.compliance = compliance  # type: ignore[attr-defined]
        compliance.kaldi = kaldi  # type: ignore[attr-defined]
    from tests.upstream import _install_stand_ins

    _install_stand_ins()  # matcha.utils without hydra / lightning


def upstream3(module: str) -> Any:
    """Import an upstream CosyVoice 3 module, e.g. ``cosyvoice.flow.DiT.dit``."""
    _prepare()
    imported = importlib.import_module(module)
    assert str(imported.__file__).startswith(os.environ["COSYVOICE3_UPSTREAM"]), imported.__file__
    return imported
