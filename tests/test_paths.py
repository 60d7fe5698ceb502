import os
from pathlib import Path

import pytest

from cosyserve.errors import ModelDirError
from cosyserve.paths import default_model_dir, require_model_dir


def test_env_var_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("COSYSERVE_MODEL_DIR", str(tmp_path / "m"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_model_dir() == tmp_path / "m"


def test_env_var_expands_the_home_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("COSYSERVE_MODEL_DIR", "~/models/cv2")
    assert default_model_dir() == tmp_path / "models" / "cv2"


def test_xdg_cache_home_is_respected(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("COSYSERVE_MODEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_model_dir() == tmp_path / "cache" / "cosyserve" / "models" / "CosyVoice2-0.5B"


@pytest.mark.parametrize("xdg", ["", "relative/cache"])
def test_unset_or_relative_xdg_falls_back_to_home_cache(
    xdg: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("COSYSERVE_MODEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / ".cache" / "cosyserve" / "models" / "CosyVoice2-0.5B"


def test_require_model_dir(tmp_path: Path) -> None:
    assert require_model_dir(tmp_path) == tmp_path
    with pytest.raises(ModelDirError, match=r"does not exist; pass --model-dir DIR .*cosyserve model init"):
        require_model_dir(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelDirError, match="is not a directory"):
        require_model_dir(tmp_path / "file")


def test_the_first_of_several_model_dirs_is_the_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("COSYSERVE_MODEL_DIR", f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}")
    assert default_model_dir() == tmp_path / "a"
