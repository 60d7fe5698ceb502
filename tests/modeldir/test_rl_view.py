"""The RL-tuned LM's view of a Fun-CosyVoice3 directory: served and verified like any
directory, its LM the RL one's weights."""

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cosyserve.cli.main import app
from cosyserve.engine.loader import load_model
from cosyserve.errors import ModelDirError
from cosyserve.modeldir.hparams3 import LM3Config
from cosyserve.modeldir.manifest import check_manifest
from cosyserve.modeldir.rl_view import make_rl_view
from cosyserve.models.lm3 import lm3_checkpoint_table
from cosyserve.weights.checkpoint import read_state_dict


def test_the_view_serves_the_rl_lm(tiny3_model_dir: Path, tmp_path: Path) -> None:
    view = make_rl_view(tiny3_model_dir, tmp_path / "rl")
    assert (view / "llm.pt").resolve() == (tiny3_model_dir / "llm.rl.pt").resolve()
    assert check_manifest(view) == []  # its own manifest, verified against the linked files
    model = load_model(view)
    rl = read_state_dict(tiny3_model_dir / "llm.rl.pt")
    base = read_state_dict(tiny3_model_dir / "llm.pt")
    loaded = model.lm.state_dict()
    assert isinstance(model.hparams.lm, LM3Config)
    for checkpoint_key, module_key in lm3_checkpoint_table(model.hparams.lm).entries:
        assert torch.equal(loaded[module_key], rl[checkpoint_key]), checkpoint_key
    assert not torch.equal(rl["speech_embedding.weight"], base["speech_embedding.weight"])


def test_a_directory_without_an_rl_lm_has_no_view(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match=r"has no llm.rl.pt"):
        make_rl_view(tiny_model_dir, tmp_path / "rl")
    assert not (tmp_path / "rl").exists()


def test_model_rl_command(tiny3_model_dir: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["model", "rl", str(tiny3_model_dir), str(tmp_path / "rl")])
    assert result.exit_code == 0, result.output
    assert "serve it with --model-dir" in result.output
    again = CliRunner().invoke(app, ["model", "rl", str(tiny3_model_dir), str(tmp_path / "rl")])
    assert again.exit_code == 2 and "already exists" in again.stderr
