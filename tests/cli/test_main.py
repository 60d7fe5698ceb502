import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from cosyserve.cli.main import app
from cosyserve.modeldir.layout import ModelDir


def test_model_init_writes_a_directory_and_reports_it(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    result = CliRunner().invoke(app, ["model", "init", str(target), "--size", "tiny", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "llm.pt" in result.stdout and "CosyVoice-BlankEN/vocab.json" in result.stdout
    assert result.stdout.splitlines()[-1].startswith(f"wrote {target} (cosyvoice2 tiny, seed 3): ")
    ModelDir.open(target)


def test_model_init_writes_a_cosyvoice3_directory(tmp_path: Path) -> None:
    target = tmp_path / "cv3"
    args = ["model", "init", str(target), "--size", "tiny", "--family", "cosyvoice3", "--rl-lm"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and "(cosyvoice3 tiny, seed 0)" in result.output
    assert (target / "cosyvoice3.yaml").is_file() and (target / "llm.rl.pt").is_file()
    wrong = CliRunner().invoke(
        app, ["model", "init", str(tmp_path / "x"), "--size", "tiny", "--family", "v4"]
    )
    assert wrong.exit_code == 2


def test_model_error_is_one_line_on_stderr_with_exit_2(tmp_path: Path) -> None:
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "x").write_text("")
    result = CliRunner().invoke(app, ["model", "init", str(tmp_path / "occupied"), "--size", "tiny"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == f"error: {tmp_path / 'occupied'} is not empty; pass force to replace it\n"


def test_size_is_required_and_checked(tmp_path: Path) -> None:
    missing = CliRunner().invoke(app, ["model", "init", str(tmp_path / "x")])
    assert missing.exit_code == 2
    assert "--size" in missing.stderr
    wrong = CliRunner().invoke(app, ["model", "init", str(tmp_path / "x"), "--size", "huge"])
    assert wrong.exit_code == 2
    assert "huge" in wrong.stderr
    assert not (tmp_path / "x").exists()


def test_console_script_error_path_has_no_traceback(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    script = Path(sys.executable).parent / "cosyserve"
    done = subprocess.run(
        [str(script), "model", "init", str(tmp_path / "file"), "--size", "tiny"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr == f"error: {tmp_path / 'file'} exists and is not a directory\n"
    assert done.stdout == ""
