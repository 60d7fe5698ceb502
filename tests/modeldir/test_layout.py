import re
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from cosyserve.errors import CheckpointError, ModelDirError
from cosyserve.modeldir.family import LLM_FILE, YAML_FILE, Family
from cosyserve.modeldir.layout import QWEN_DIR, REQUIRED_QWEN_FILES, SPK2INFO_FILE, ModelDir
from cosyserve.modeldir.presets import TINY
from cosyserve.weights.checkpoint import read_state_dict


def _view(src: Path, dst: Path, replace: Iterable[str] = ()) -> Path:
    """A cheap copy of ``src``: symlinks to every entry except those in ``replace``
    (relative paths, also inside CosyVoice-BlankEN/), which are left out for the test
    to write or omit."""
    skip = set(replace)
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name in skip:
            continue
        if entry.name == QWEN_DIR and any(s.startswith(QWEN_DIR + "/") for s in skip):
            _view(entry, dst / QWEN_DIR, [s.removeprefix(QWEN_DIR + "/") for s in skip])
        else:
            (dst / entry.name).symlink_to(entry)
    return dst


def test_tiny_dir_opens_with_all_paths(tiny_model_dir: Path) -> None:
    model_dir = ModelDir.open(tiny_model_dir)
    assert model_dir.llm == tiny_model_dir / LLM_FILE
    assert model_dir.family is Family.COSYVOICE2
    assert model_dir.llm_rl is None
    assert model_dir.spk2info == tiny_model_dir / SPK2INFO_FILE
    assert model_dir.hparams() == TINY


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match=r"nope does not exist"):
        ModelDir.open(tmp_path / "nope")


def test_file_instead_of_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelDirError, match=r"file is not a directory"):
        ModelDir.open(tmp_path / "file")


@pytest.mark.parametrize(
    "missing",
    [
        *Family.COSYVOICE2.required_files[1:],  # without its yaml it is no model directory
        QWEN_DIR,
        *(f"{QWEN_DIR}/{name}" for name in REQUIRED_QWEN_FILES),
    ],
)
def test_each_missing_file_is_named(tiny_model_dir: Path, tmp_path: Path, missing: str) -> None:
    broken = _view(tiny_model_dir, tmp_path / "m", replace=[missing])
    expected = missing + "/" if missing == QWEN_DIR else missing
    with pytest.raises(ModelDirError, match=rf"is incomplete: missing {expected} \(expected"):
        ModelDir.open(broken)


def test_all_missing_files_are_listed(tmp_path: Path) -> None:
    (tmp_path / YAML_FILE).write_text("")
    with pytest.raises(ModelDirError, match=re.escape("missing llm.pt, flow.pt, hift.pt, campplus.onnx")):
        ModelDir.open(tmp_path)


def test_v1_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cosyvoice.yaml").write_text("llm: 1\n")
    with pytest.raises(
        ModelDirError, match=r"is a CosyVoice \(v1\) model directory \(cosyvoice.yaml\); only CosyVoice2-0.5B"
    ):
        ModelDir.open(tmp_path)


def test_directory_without_a_model_yaml_is_refused(tmp_path: Path) -> None:
    (tmp_path / "llm.pt").write_bytes(b"")
    with pytest.raises(ModelDirError, match=r"has neither cosyvoice2.yaml nor cosyvoice3.yaml"):
        ModelDir.open(tmp_path)


def test_cosyvoice3_yaml_makes_a_cosyvoice3_directory(tmp_path: Path) -> None:
    (tmp_path / "cosyvoice3.yaml").write_text("")
    with pytest.raises(
        ModelDirError, match=re.escape("llm.pt, flow.pt, hift.pt, campplus.onnx, speech_tokenizer_v3.onnx")
    ) as info:
        ModelDir.open(tmp_path)
    assert "Fun-CosyVoice3-0.5B-2512 layout" in str(info.value)


def test_extra_v1_yaml_next_to_cosyvoice2_yaml_is_ignored(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Some CosyVoice2-0.5B mirrors carry a cosyvoice.yaml as well.
    view = _view(tiny_model_dir, tmp_path / "v")
    (view / "cosyvoice.yaml").write_text("")
    assert ModelDir.open(view).hparams() == TINY


def test_spk2info_is_optional(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = ModelDir.open(_view(tiny_model_dir, tmp_path / "v", replace=[SPK2INFO_FILE]))
    assert model_dir.spk2info is None
    assert model_dir.read_spk2info() == {}


def test_read_spk2info(tiny_model_dir: Path) -> None:
    speakers = ModelDir.open(tiny_model_dir).read_spk2info()
    assert list(speakers) == ["中文女", "英文男"]
    for embedding in speakers.values():
        assert embedding.shape == (1, 192)
        assert embedding.dtype == torch.float32


def _with_spk2info(tiny_model_dir: Path, tmp_path: Path, content: object | bytes) -> ModelDir:
    view = _view(tiny_model_dir, tmp_path / "v", replace=[SPK2INFO_FILE])
    if isinstance(content, bytes):
        (view / SPK2INFO_FILE).write_bytes(content)
    else:
        torch.save(content, view / SPK2INFO_FILE)
    return ModelDir.open(view)


def test_zero_shot_speaker_entries_use_flow_embedding(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The shape of an entry written by upstream's add_zero_shot_spk + save_spkinfo.
    entry = {
        "prompt_text": torch.zeros(1, 5, dtype=torch.int32),
        "llm_embedding": torch.ones(1, 192),
        "flow_embedding": torch.ones(1, 192),
        "llm_prompt_speech_token": torch.zeros(1, 75, dtype=torch.int32),
    }
    model_dir = _with_spk2info(tiny_model_dir, tmp_path, {"me": entry})
    assert torch.equal(model_dir.read_spk2info()["me"], torch.ones(1, 192))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00garbage", "not a loadable speaker table"),
        ([1, 2], "not a mapping of speaker name"),
        ({"a": 1}, "speaker 'a' is not a mapping"),
        ({"a": {"x": torch.ones(1, 192)}}, "speaker 'a' has no 'embedding' tensor"),
        ({"a": {"embedding": torch.ones(1, 80)}}, r"embedding has shape \(1, 80\)"),
        ({3: {"embedding": torch.ones(1, 192)}}, "speaker name 3 is not a string"),
    ],
)
def test_bad_spk2info(tiny_model_dir: Path, tmp_path: Path, content: object, message: str) -> None:
    with pytest.raises(ModelDirError, match=message):
        _with_spk2info(tiny_model_dir, tmp_path, content).read_spk2info()


def test_truncated_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    view = _view(tiny_model_dir, tmp_path / "v", replace=[LLM_FILE])
    data = (tiny_model_dir / LLM_FILE).read_bytes()
    (view / LLM_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=re.escape("llm.pt: checkpoint is truncated or corrupt")):
        read_state_dict(ModelDir.open(view).llm)


def test_corrupt_checkpoint_bytes(tiny_model_dir: Path, tmp_path: Path) -> None:
    view = _view(tiny_model_dir, tmp_path / "v", replace=[LLM_FILE])
    (view / LLM_FILE).write_bytes(bytes(range(256)) * 64)
    with pytest.raises(CheckpointError, match=re.escape("llm.pt: checkpoint is")):
        read_state_dict(ModelDir.open(view).llm)


def test_tokenizer_dir_that_does_not_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    view = _view(tiny_model_dir, tmp_path / "v", replace=[f"{QWEN_DIR}/vocab.json"])
    (view / QWEN_DIR / "vocab.json").write_text("{truncated", encoding="utf-8")
    model_dir = ModelDir.open(view)
    with pytest.raises(ModelDirError, match=re.escape("vocab.json: not readable JSON")):
        model_dir.text_tokenizer()


def test_unreadable_qwen_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    view = _view(tiny_model_dir, tmp_path / "v", replace=[f"{QWEN_DIR}/config.json"])
    (view / QWEN_DIR / "config.json").write_text("[", encoding="utf-8")
    with pytest.raises(ModelDirError, match="cannot read the Qwen2 config"):
        ModelDir.open(view).hparams()


def test_tiny_tokenizer_loads(tiny_model_dir: Path) -> None:
    assert ModelDir.open(tiny_model_dir).text_tokenizer().vocab_size == 151663
