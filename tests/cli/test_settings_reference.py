from pathlib import Path

from typer.testing import CliRunner

from cosyserve.cli.main import app
from cosyserve.server.settings import Settings, settings_reference

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
MOST_SETTINGS = 40  # what an operator decides; speed choices are the plan's


def _rows() -> list[tuple[str, str, str, str]]:
    return [row for _group, rows in settings_reference() for row in rows]


def test_every_setting_is_in_one_group() -> None:
    names = [row[0] for row in _rows()]
    assert sorted(names) == sorted(Settings.model_fields) and len(set(names)) == len(names)
    assert [group for group, _ in settings_reference()] == ["model", "server", "limits", "auth", "logging"]


def test_the_settings_are_few() -> None:
    assert len(Settings.model_fields) <= MOST_SETTINGS


def test_configuration_lists_every_setting_with_its_variable() -> None:
    text = CONFIGURATION.read_text(encoding="utf-8")
    for group, rows in settings_reference():
        assert f"### {group.capitalize()}" in text, group
        for name, env, _default, _ in rows:
            assert f"| `{name}` | `{env}` |" in text, name
    listed = [line.split("`")[1] for line in text.splitlines() if line.startswith("| `")]
    settings_section = listed[-len(Settings.model_fields) :]
    assert sorted(settings_section) == sorted(Settings.model_fields)  # none documented that is gone


def test_serve_help_lists_every_setting_by_group() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    for group, rows in settings_reference():
        assert group.upper() in result.output
        for _name, env, _default, _ in rows:
            assert env in result.output, env
    for panel in ("Model", "Server", "Limits", "Auth", "Logging"):
        assert f"─ {panel} ─" in result.output, panel
