"""Generate a complete CosyVoice2 model directory with random weights in the official format.

The official weights cannot be downloaded here, so tests and benchmarks run on generated
directories: the same files, key names, shapes and dtypes as CosyVoice2-0.5B (or a tiny
geometry), seeded so that the same seed gives byte-identical files.

The directory is built in a temporary sibling and renamed into place, so an interrupted
run never leaves a half-written model directory behind.
"""

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from cosyserve.errors import ModelDirError
from cosyserve.modeldir import onnx_models
from cosyserve.modeldir.hparams import ModelHParams
from cosyserve.modeldir.layout import (
    CAMPPLUS_FILE,
    FLOW_FILE,
    HIFT_FILE,
    LLM_FILE,
    QWEN_DIR,
    SPEAKER_EMBED_DIM,
    SPEECH_TOKENIZER_FILE,
    SPK2INFO_FILE,
    YAML_FILE,
)
from cosyserve.modeldir.manifest import write_manifest
from cosyserve.modeldir.presets import PRESETS
from cosyserve.modeldir.qwen_files import write_qwen_config, write_qwen_weights, write_tokenizer_files
from cosyserve.modeldir.yamlwrite import render_yaml
from cosyserve.models.flow.flow import Flow, flow_checkpoint_table
from cosyserve.models.hift.generator import HiFTGenerator, hift_checkpoint_table
from cosyserve.models.lm import CosyVoice2LM, lm_checkpoint_table
from cosyserve.weights.checkpoint import CheckpointTable, to_checkpoint
from cosyserve.weights.randomize import randomize_

logger = logging.getLogger(__name__)

# Upstream's v1 SFT speaker names; CosyVoice2-0.5B ships none, but a built-in speaker
# lets the sft path be exercised.
SPEAKERS = ("中文女", "英文男")
_DIR_MODE = 0o755
_FILE_MODE = 0o644


def derive_seed(seed: int, part: str) -> int:
    """An independent 63-bit seed per generated part, stable across runs and platforms."""
    digest = hashlib.sha256(f"cosyserve:{seed}:{part}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def init_model_dir(path: Path | str, size: str, seed: int, force: bool = False) -> None:
    """Write a complete model directory of geometry ``size`` ("tiny" or "full") at ``path``.

    Refuses (:class:`ModelDirError`) to replace an existing non-empty directory unless
    ``force``. Peak memory stays near the largest single network: each is built, saved
    and freed before the next.
    """
    if size not in PRESETS:
        raise ModelDirError(f"unknown model size {size!r}; choose one of {', '.join(PRESETS)}")
    target = Path(path)
    _check_target(target, force)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        _write_all(staging, PRESETS[size], seed)
        _replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("model directory %s written (%s, seed %d)", target, size, seed)


def _check_target(target: Path, force: bool) -> None:
    if target.exists() and not target.is_dir():
        raise ModelDirError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise ModelDirError(f"{target} is not empty; pass force to replace it")


def _replace(staging: Path, target: Path) -> None:
    if not target.exists():
        staging.rename(target)
        return
    # Move the old directory aside first, so that the target name always holds a
    # complete directory (old or new) except for the instant between two renames.
    trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    target.rename(trash / "old")
    staging.rename(target)
    shutil.rmtree(trash)


def _write_all(root: Path, hp: ModelHParams, seed: int) -> None:
    (root / YAML_FILE).write_text(render_yaml(hp), encoding="utf-8")
    qwen = root / QWEN_DIR
    qwen.mkdir()
    write_qwen_config(qwen, hp.lm.qwen)
    write_tokenizer_files(qwen)

    llm = _write_network(
        root / LLM_FILE, lambda: CosyVoice2LM(hp.lm), lm_checkpoint_table(hp.lm), derive_seed(seed, "llm")
    )
    write_qwen_weights(qwen, llm)
    del llm
    _write_network(
        root / FLOW_FILE, lambda: Flow(hp.flow), flow_checkpoint_table(hp.flow), derive_seed(seed, "flow")
    )
    _write_network(
        root / HIFT_FILE,
        lambda: HiFTGenerator(hp.hift),
        hift_checkpoint_table(hp.hift),
        derive_seed(seed, "hift"),
    )

    onnx_models.save(onnx_models.campplus_model(derive_seed(seed, "campplus")), root / CAMPPLUS_FILE)
    onnx_models.save(
        onnx_models.speech_tokenizer_model(derive_seed(seed, "speech_tokenizer")),
        root / SPEECH_TOKENIZER_FILE,
    )
    _write_spk2info(root / SPK2INFO_FILE, derive_seed(seed, "spk2info"))
    write_manifest(root)  # last: it covers every other file
    _make_readable(root)


def _write_network(
    path: Path, build: Callable[[], nn.Module], table: CheckpointTable, seed: int
) -> dict[str, torch.Tensor]:
    """Build, randomise and save one network as an fp32 official checkpoint; returns the
    checkpoint (whose tensors keep the module's storage alive until the caller drops it)."""
    module = build()
    randomize_(module, torch.Generator().manual_seed(seed))
    checkpoint = to_checkpoint(module, table)
    # torch.save names the archive's root folder after the file, so it must be saved under
    # its final name for the bytes to be reproducible.
    torch.save(checkpoint, path)
    logger.debug("wrote %s: %d tensors", path.name, len(checkpoint))
    return checkpoint


def _write_spk2info(path: Path, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    table = {name: {"embedding": torch.randn(1, SPEAKER_EMBED_DIM, generator=generator)} for name in SPEAKERS}
    torch.save(table, path)


def _make_readable(root: Path) -> None:
    # mkdtemp creates the staging directory 0700 and some writers create 0600 files; a
    # model directory is shared read-only data, like a downloaded one.
    for path in [root, *root.rglob("*")]:
        path.chmod(_DIR_MODE if path.is_dir() else _FILE_MODE)
