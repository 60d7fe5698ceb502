from pathlib import Path

from typer.testing import CliRunner

from cosyserve.cli.main import app
from cosyserve.server.settings import Settings, settings_reference

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_reference_covers_every_setting() -> None:
    assert [row[0] for row in settings_reference()] == list(Settings.model_fields)


def test_configuration_lists_every_setting_with_its_variable() -> None:
    text = CONFIGURATION.read_text(encoding="utf-8")
    for name, env, _default, _ in settings_reference():
        assert f"| `{name}` | `{env}` |" in text, name


def test_serve_help_lists_every_setting() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    for _name, env, _default, _ in settings_reference():
        assert env in result.output, env
