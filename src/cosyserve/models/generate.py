"""Generate a complete model directory with random weights in the official format.

The official weights cannot be downloaded here, so tests and benchmarks run on generated
directories: the same files, key names, shapes and dtypes as CosyVoice2-0.5B or
Fun-CosyVoice3-0.5B-2512 (or a tiny geometry), seeded so that the same seed gives
byte-identical files.

The directory is built in a temporary sibling and renamed into place, so an interrupted
run never leaves a half-written model directory behind.
"""

import hashlib
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cosyserve.errors import ModelDirError
from cosyserve.modeldir import onnx_models
from cosyserve.modeldir.family import CAMPPLUS_FILE, FLOW_FILE, HIFT_FILE, LLM_FILE, Family
from cosyserve.modeldir.hparams import ModelHParams
from cosyserve.modeldir.hparams3 import Model3HParams
from cosyserve.modeldir.layout import LLM_RL_FILE, QWEN_DIR, SPEAKER_EMBED_DIM, SPK2INFO_FILE
from cosyserve.modeldir.manifest import write_manifest
from cosyserve.modeldir.presets import PRESETS, PRESETS3
from cosyserve.modeldir.qwen_files import write_qwen_config, write_qwen_weights, write_tokenizer_files
from cosyserve.modeldir.yamlwrite import render_yaml
from cosyserve.modeldir.yamlwrite3 import render_yaml3
from cosyserve.models.dit import Flow3, flow3_checkpoint_table
from cosyserve.models.flow.flow import Flow, flow_checkpoint_table
from cosyserve.models.hift.generator import HiFTGenerator, hift_checkpoint_table
from cosyserve.models.hift3 import CausalHiFTGenerator, causal_hift_checkpoint_table
from cosyserve.models.lm import CosyVoice2LM, lm_checkpoint_table
from cosyserve.models.lm3 import CosyVoice3LM, lm3_checkpoint_table
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


def init_model_dir(
    path: Path | str,
    size: str,
    seed: int,
    force: bool = False,
    family: Family | str = Family.COSYVOICE2,
    rl_lm: bool = False,
) -> None:
    """Write a complete model directory of ``family`` and geometry ``size`` ("tiny" or
    "full") at ``path``. ``rl_lm`` (CosyVoice 3) adds ``llm.rl.pt``, an RL-tuned LM of the
    same shape with its own random weights.

    Refuses (:class:`ModelDirError`) to replace an existing non-empty directory unless
    ``force``. Peak memory stays near the largest single network: each is built, saved
    and freed before the next.
    """
    family = Family(family)
    presets = PRESETS if family is Family.COSYVOICE2 else PRESETS3
    if size not in presets:
        raise ModelDirError(f"unknown model size {size!r}; choose one of {', '.join(presets)}")
    if rl_lm and family is not Family.COSYVOICE3:
        raise ModelDirError("only CosyVoice 3 directories have an RL-tuned LM (llm.rl.pt)")
    target = Path(path)
    _check_target(target, force)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        _write_all(staging, presets[size], seed, rl_lm)
        _replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("model directory %s written (%s %s, seed %d)", target, family, size, seed)


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


@dataclass(frozen=True)
class _Network:
    file: str
    build: Callable[[], nn.Module]
    table: CheckpointTable
    part: str  # names its seed


def _networks(hp: ModelHParams | Model3HParams, rl_lm: bool) -> list[_Network]:
    """The family's three networks, the LM first (its backbone also goes to the Qwen2 folder)."""
    if isinstance(hp, Model3HParams):
        lm3 = _Network(LLM_FILE, lambda: CosyVoice3LM(hp.lm), lm3_checkpoint_table(hp.lm), "llm")
        rl = [_Network(LLM_RL_FILE, lm3.build, lm3.table, "llm_rl")] if rl_lm else []
        return [
            lm3,
            *rl,
            _Network(FLOW_FILE, lambda: Flow3(hp.flow), flow3_checkpoint_table(hp.flow), "flow"),
            _Network(
                HIFT_FILE, lambda: CausalHiFTGenerator(hp.hift), causal_hift_checkpoint_table(hp.hift), "hift"
            ),
        ]
    return [
        _Network(LLM_FILE, lambda: CosyVoice2LM(hp.lm), lm_checkpoint_table(hp.lm), "llm"),
        _Network(FLOW_FILE, lambda: Flow(hp.flow), flow_checkpoint_table(hp.flow), "flow"),
        _Network(HIFT_FILE, lambda: HiFTGenerator(hp.hift), hift_checkpoint_table(hp.hift), "hift"),
    ]


def _write_all(root: Path, hp: ModelHParams | Model3HParams, seed: int, rl_lm: bool) -> None:
    family = Family.COSYVOICE3 if isinstance(hp, Model3HParams) else Family.COSYVOICE2
    yaml = render_yaml3(hp) if isinstance(hp, Model3HParams) else render_yaml(hp)
    (root / family.yaml_file).write_text(yaml, encoding="utf-8")
    qwen = root / QWEN_DIR
    qwen.mkdir()
    write_qwen_config(qwen, hp.lm.qwen)
    write_tokenizer_files(qwen)
    for network in _networks(hp, rl_lm):
        seed_of = derive_seed(seed, network.part)
        checkpoint = _write_network(root / network.file, network.build, network.table, seed_of)
        if network.file == LLM_FILE:
            write_qwen_weights(qwen, checkpoint)
        del checkpoint

    onnx_models.save(onnx_models.campplus_model(derive_seed(seed, "campplus")), root / CAMPPLUS_FILE)
    tokenizer_file = family.speech_tokenizer_file
    tokenizer = onnx_models.speech_tokenizer_model(
        derive_seed(seed, "speech_tokenizer"), tokenizer_file.removesuffix(".onnx")
    )
    onnx_models.save(tokenizer, root / tokenizer_file)
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
