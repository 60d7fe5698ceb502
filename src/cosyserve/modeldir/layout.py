"""The official model directories: file names, the model family, validation and small readers.

Two families are served: CosyVoice 2 (CosyVoice2-0.5B, ``cosyvoice2.yaml``) and CosyVoice 3
(Fun-CosyVoice3-0.5B-2512, ``cosyvoice3.yaml``). The yaml upstream's ``AutoModel``
dispatches on decides the family. :meth:`ModelDir.open` checks the layout only (cheap, no
tensor is read); the readers
(:meth:`ModelDir.hparams`, :meth:`ModelDir.text_tokenizer`, :meth:`ModelDir.read_spk2info`)
parse their files on demand. Every problem is a :class:`ModelDirError` that names the file.
"""

import logging
import pickle
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from cosyserve.errors import ModelDirError
from cosyserve.frontend.text_tokenizer import (
    COSYVOICE3_SPECIAL_TOKENS,
    MERGES_FILE,
    TOKENIZER_CONFIG_FILE,
    VOCAB_FILE,
    TextTokenizer,
)
from cosyserve.modeldir.family import (
    CAMPPLUS_FILE,
    FLOW_FILE,
    HIFT_FILE,
    LLM_FILE,
    YAML3_FILE,
    YAML_FILE,
    Family,
)
from cosyserve.modeldir.hparams import ModelHParams, hparams_from_yaml, qwen2_config_from_json
from cosyserve.modeldir.hparams3 import Model3HParams, hparams3_from_yaml

logger = logging.getLogger(__name__)

# The RL-tuned LM of Fun-CosyVoice3-0.5B-2512, a drop-in replacement of llm.pt.
LLM_RL_FILE = "llm.rl.pt"
SPK2INFO_FILE = "spk2info.pt"
QWEN_DIR = "CosyVoice-BlankEN"
QWEN_CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.sha256"

# model.safetensors is not required: llm.pt overwrites every backbone weight.
REQUIRED_QWEN_FILES = (QWEN_CONFIG_FILE, VOCAB_FILE, MERGES_FILE, TOKENIZER_CONFIG_FILE)
SPEAKER_EMBED_DIM = 192


_V1_YAML = "cosyvoice.yaml"
_SUPPORTED = "CosyVoice2-0.5B (cosyvoice2.yaml) and Fun-CosyVoice3-0.5B-2512 (cosyvoice3.yaml) are supported"


@dataclass(frozen=True)
class ModelDir:
    """Paths of a validated model directory of ``family``. ``spk2info`` is None when
    absent (upstream then has no built-in speakers); ``llm_rl`` is the RL-tuned LM when
    the directory ships one (CosyVoice 3)."""

    root: Path
    family: Family
    yaml: Path
    llm: Path
    flow: Path
    hift: Path
    campplus: Path
    speech_tokenizer: Path
    spk2info: Path | None
    qwen: Path
    llm_rl: Path | None = None

    @classmethod
    def open(cls, path: Path | str) -> "ModelDir":
        """Validate the layout of ``path``; :class:`ModelDirError` says what is wrong."""
        root = Path(path)
        if not root.exists():
            raise ModelDirError(f"model directory {root} does not exist")
        if not root.is_dir():
            raise ModelDirError(f"model directory {root} is not a directory")
        family = detect_family(root)
        missing = [name for name in family.required_files if not (root / name).is_file()]
        qwen = root / QWEN_DIR
        if not qwen.is_dir():
            missing.append(QWEN_DIR + "/")
        else:
            missing += [f"{QWEN_DIR}/{n}" for n in REQUIRED_QWEN_FILES if not (qwen / n).is_file()]
        if missing:
            raise ModelDirError(
                f"model directory {root} is incomplete: missing {', '.join(missing)} "
                f"(expected the {family.official_name} layout)"
            )
        spk2info = root / SPK2INFO_FILE
        llm_rl = root / LLM_RL_FILE
        return cls(
            root=root,
            family=family,
            yaml=root / family.yaml_file,
            llm=root / LLM_FILE,
            flow=root / FLOW_FILE,
            hift=root / HIFT_FILE,
            campplus=root / CAMPPLUS_FILE,
            speech_tokenizer=root / family.speech_tokenizer_file,
            spk2info=spk2info if spk2info.is_file() else None,
            qwen=qwen,
            llm_rl=llm_rl if family is Family.COSYVOICE3 and llm_rl.is_file() else None,
        )

    def hparams(self) -> ModelHParams | Model3HParams:
        """Hyperparameters from the family's yaml and ``CosyVoice-BlankEN/config.json``."""
        try:
            text = self.yaml.read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            raise ModelDirError(f"{self.yaml}: not readable ({exc.__class__.__name__})") from None
        qwen = qwen2_config_from_json(self.qwen / QWEN_CONFIG_FILE)
        if self.family is Family.COSYVOICE3:
            return hparams3_from_yaml(text, qwen)
        return hparams_from_yaml(text, qwen)

    def text_tokenizer(self) -> TextTokenizer:
        if self.family is Family.COSYVOICE3:
            return TextTokenizer.from_dir(self.qwen, COSYVOICE3_SPECIAL_TOKENS)
        return TextTokenizer.from_dir(self.qwen)

    def read_spk2info(self) -> dict[str, torch.Tensor]:
        """Built-in speakers: name -> speaker embedding ``(1, 192)`` float32.

        SFT entries carry ``embedding``; entries saved by upstream's ``add_zero_shot_spk``
        carry ``flow_embedding`` (the same vector) instead. Empty without ``spk2info.pt``.
        """
        if self.spk2info is None:
            return {}
        path = self.spk2info
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except (
            RuntimeError,
            EOFError,
            OSError,
            ValueError,
            pickle.UnpicklingError,
            zipfile.BadZipFile,
        ) as exc:
            raise ModelDirError(f"{path}: not a loadable speaker table ({exc.__class__.__name__})") from None
        if not isinstance(data, Mapping):
            raise ModelDirError(f"{path}: not a mapping of speaker name -> speaker info")
        return {
            _speaker_name(path, name): _speaker_embedding(path, name, info) for name, info in data.items()
        }


def detect_family(root: Path) -> Family:
    """The family of the directory ``root`` from its yaml, as upstream's ``AutoModel``
    decides (CosyVoice 2 first when both yamls are there, with a warning)."""
    present = [family for family in Family if (root / family.yaml_file).is_file()]
    if len(present) > 1:
        both = " and ".join(f.yaml_file for f in present)
        logger.warning("%s: both %s; serving it as CosyVoice 2", root, both)
    if present:
        return present[0]
    if (root / _V1_YAML).exists():
        raise ModelDirError(f"{root} is a CosyVoice (v1) model directory ({_V1_YAML}); only {_SUPPORTED}")
    raise ModelDirError(
        f"{root} is not a CosyVoice model directory: it has neither {YAML_FILE} nor {YAML3_FILE} "
        f"(only {_SUPPORTED})"
    )


def _speaker_name(path: Path, name: object) -> str:
    if not isinstance(name, str):
        raise ModelDirError(f"{path}: speaker name {name!r} is not a string")
    return name


def _speaker_embedding(path: Path, name: str, info: object) -> torch.Tensor:
    if not isinstance(info, Mapping):
        raise ModelDirError(f"{path}: speaker {name!r} is not a mapping")
    embedding = info.get("embedding", info.get("flow_embedding"))
    if not isinstance(embedding, torch.Tensor):
        raise ModelDirError(f"{path}: speaker {name!r} has no 'embedding' tensor")
    if embedding.numel() != SPEAKER_EMBED_DIM or not embedding.is_floating_point():
        raise ModelDirError(
            f"{path}: speaker {name!r} embedding has shape {tuple(embedding.shape)} "
            f"and dtype {embedding.dtype}, expected ({SPEAKER_EMBED_DIM},) floats"
        )
    return embedding.reshape(1, SPEAKER_EMBED_DIM).to(torch.float32)
