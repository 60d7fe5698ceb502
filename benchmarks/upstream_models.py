"""Upstream's whole model over one of our model directories, per model family, for
``benchmarks/upstream_engine.py`` (test-only references; cosyserve never imports them).

- CosyVoice 2: ``CosyVoice2Model`` of the PyPI reference (``cosyvoice-minicpmo``), built by
  ``tests/pipeline/upstream_model.py``.
- CosyVoice 3: ``CosyVoice3Model`` of a checkout of FunAudioLLM/CosyVoice at ``ace7c47``
  (the PyPI reference predates CosyVoice 3), imported through ``tests/upstream3.py``, which
  needs :data:`UPSTREAM3_ENV` in the environment of the process that builds it.

Both are built the way upstream's ``CosyVoice2`` / ``CosyVoice3`` classes build them: the
``llm``, ``flow`` and ``hift`` sections of the directory's yaml with hyperpyyaml
(``qwen_pretrain_path`` set to ``DIR/CosyVoice-BlankEN``), then llm.pt, flow.pt and
hift.pt loaded strictly; fp32 on the CPU. What makes upstream's work comparable with ours
(forced length, decode mask) is the same for both families and stays in
``tests/pipeline/upstream_model.py``: CosyVoice 3's LM lists all its 200 stop ids
(6561..6760) in ``stop_token_ids``, which the forced sampling masks.
"""

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from cosyserve.modeldir.family import FLOW_FILE, HIFT_FILE, LLM_FILE, Family
from cosyserve.modeldir.layout import QWEN_DIR, ModelDir

# The upstream checkout and the folder of its extra packages (tests/upstream3.py).
UPSTREAM3_ENV = ("COSYVOICE3_UPSTREAM", "COSYVOICE3_SITE")


def upstream_unavailable(family: Family, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why upstream's model of ``family`` cannot be built with ``environ`` (None: it can)."""
    if family is Family.COSYVOICE2:
        return None  # the PyPI reference is installed with the test dependencies
    unset = [name for name in UPSTREAM3_ENV if not environ.get(name)]
    absent = [
        f"{name}={environ[name]}"
        for name in UPSTREAM3_ENV
        if environ.get(name) and not Path(environ[name]).is_dir()
    ]
    if not unset and not absent:
        return None
    problem = f"{', '.join(unset)} not set" if unset else f"not a directory: {', '.join(absent)}"
    return (
        f"a CosyVoice 3 directory: upstream's CosyVoice3Model comes from a checkout of FunAudioLLM/CosyVoice "
        f"at ace7c47 (tests/upstream3.py); set COSYVOICE3_UPSTREAM (the checkout, e.g. /tmp/upstream) and "
        f"COSYVOICE3_SITE (its extra packages, e.g. /tmp/upv3-site) ({problem}), or run --sides ours"
    )


def build_upstream(model_dir: Path) -> Any:
    """Upstream's model of ``model_dir``'s family over its files (fp32, CPU, eval)."""
    if ModelDir.open(model_dir).family is Family.COSYVOICE2:
        from tests.pipeline.upstream_model import build_upstream_model

        return build_upstream_model(model_dir)
    return build_upstream3_model(model_dir)


def build_upstream3_model(model_dir: Path) -> Any:
    """``cosyvoice.cli.model.CosyVoice3Model`` from ``model_dir``'s cosyvoice3.yaml, with its
    ``load`` reading llm.pt, flow.pt and hift.pt strictly."""
    from tests.upstream import load_yaml_sections
    from tests.upstream3 import upstream3

    # First: puts the checkout ahead of cosyvoice-minicpmo's package of the same name.
    model_class = upstream3("cosyvoice.cli.model").CosyVoice3Model
    yaml_text = ModelDir.open(model_dir).yaml.read_text()
    # Upstream's CFM reseeds the global RNGs while it is built; keep the caller's untouched.
    with torch.random.fork_rng():
        parts = load_yaml_sections(yaml_text, ("llm", "flow", "hift"), model_dir / QWEN_DIR)
    # transformers 5 builds the Qwen2 body in config.json's bfloat16; upstream's pinned 4.51
    # built it in float32, which llm.pt (float32) loads into without rounding.
    llm = parts["llm"].float()
    model = model_class(llm, parts["flow"], parts["hift"])
    model.load(str(model_dir / LLM_FILE), str(model_dir / FLOW_FILE), str(model_dir / HIFT_FILE))
    return model
