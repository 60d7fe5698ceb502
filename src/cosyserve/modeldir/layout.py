"""The official CosyVoice2-0.5B model directory: file names, validation and small readers.

:meth:`ModelDir.open` checks the layout only (cheap, no tensor is read); the readers
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
from cosyserve.frontend.text_tokenizer import MERGES_FILE, TOKENIZER_CONFIG_FILE, VOCAB_FILE, TextTokenizer
from cosyserve.modeldir.hparams import ModelHParams, hparams_from_yaml, qwen2_config_from_json

logger = logging.getLogger(__name__)

YAML_FILE = "cosyvoice2.yaml"
LLM_FILE = "llm.pt"
FLOW_FILE = "flow.pt"
HIFT_FILE = "hift.pt"
CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
SPK2INFO_FILE = "spk2info.pt"
QWEN_DIR = "CosyVoice-BlankEN"
QWEN_CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.sha256"

REQUIRED_FILES = (YAML_FILE, LLM_FILE, FLOW_FILE, HIFT_FILE, CAMPPLUS_FILE, SPEECH_TOKENIZER_FILE)
# model.safetensors is not required: llm.pt overwrites every backbone weight.
REQUIRED_QWEN_FILES = (QWEN_CONFIG_FILE, VOCAB_FILE, MERGES_FILE, TOKENIZER_CONFIG_FILE)
SPEAKER_EMBED_DIM = 192

# Other CosyVoice generations, recognised by the yaml upstream's AutoModel dispatches on.
_OTHER_VERSIONS = (("cosyvoice.yaml", "CosyVoice (v1)"), ("cosyvoice3.yaml", "CosyVoice 3"))
_SUPPORTED = "only CosyVoice2 (CosyVoice2-0.5B) model directories are supported"


@dataclass(frozen=True)
class ModelDir:
    """Paths of a validated CosyVoice2 model directory. ``spk2info`` is None when absent
    (upstream then has no built-in speakers)."""

    root: Path
    yaml: Path
    llm: Path
    flow: Path
    hift: Path
    campplus: Path
    speech_tokenizer: Path
    spk2info: Path | None
    qwen: Path

    @classmethod
    def open(cls, path: Path | str) -> "ModelDir":
        """Validate the layout of ``path``; :class:`ModelDirError` says what is wrong."""
        root = Path(path)
        if not root.exists():
            raise ModelDirError(f"model directory {root} does not exist")
        if not root.is_dir():
            raise ModelDirError(f"model directory {root} is not a directory")
        _check_version(root)
        missing = [name for name in REQUIRED_FILES if not (root / name).is_file()]
        qwen = root / QWEN_DIR
        if not qwen.is_dir():
            missing.append(QWEN_DIR + "/")
        else:
            missing += [f"{QWEN_DIR}/{n}" for n in REQUIRED_QWEN_FILES if not (qwen / n).is_file()]
        if missing:
            raise ModelDirError(
                f"model directory {root} is incomplete: missing {', '.join(missing)} "
                "(expected the CosyVoice2-0.5B layout)"
            )
        spk2info = root / SPK2INFO_FILE
        return cls(
            root=root,
            yaml=root / YAML_FILE,
            llm=root / LLM_FILE,
            flow=root / FLOW_FILE,
            hift=root / HIFT_FILE,
            campplus=root / CAMPPLUS_FILE,
            speech_tokenizer=root / SPEECH_TOKENIZER_FILE,
            spk2info=spk2info if spk2info.is_file() else None,
            qwen=qwen,
        )

    def hparams(self) -> ModelHParams:
        """Hyperparameters from ``cosyvoice2.yaml`` and ``CosyVoice-BlankEN/config.json``."""
        try:
            text = self.yaml.read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            raise ModelDirError(f"{self.yaml}: not readable ({exc.__class__.__name__})") from None
        return hparams_from_yaml(text, qwen2_config_from_json(self.qwen / QWEN_CONFIG_FILE))

    def text_tokenizer(self) -> TextTokenizer:
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


def _check_version(root: Path) -> None:
    if (root / YAML_FILE).is_file():
        for name, _ in _OTHER_VERSIONS:
            if (root / name).exists():
                logger.warning("%s: ignoring %s, %s is used", root, name, YAML_FILE)
        return
    for name, version in _OTHER_VERSIONS:
        if (root / name).exists():
            raise ModelDirError(f"{root} is a {version} model directory ({name}); {_SUPPORTED}")


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
