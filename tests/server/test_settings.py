"""Settings precedence (flags > environment > TOML file > defaults) and one-line errors."""

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cosyserve.accel.precision_choices import Choices, Dtype, FlowQuantization, Profile, Quantization
from cosyserve.cli.main import app
from cosyserve.server.settings import Settings, SettingsError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("COSYSERVE_CONFIG", "COSYSERVE_PORT", "COSYSERVE_MAX_ACTIVE", "COSYSERVE_MODEL_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_defaults(tmp_path: Path) -> None:
    settings = Settings.load()
    assert (settings.host, settings.port, settings.grpc_port, settings.workers) == (
        "127.0.0.1",
        8000,
        50051,
        1,
    )
    assert settings.max_text_chars == 2000 and settings.pronunciations == ""
    assert settings.model_dir == (tmp_path / "cache" / "cosyserve" / "models" / "CosyVoice2-0.5B",)
    assert settings.first_model_dir == settings.model_dir[0]
    assert Path(settings.voices_db).parent == tmp_path / "cache" / "cosyserve"


def test_model_dir_env_is_the_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("COSYSERVE_MODEL_DIR", str(tmp_path / "m"))
    assert Settings.load().model_dir == (tmp_path / "m",)


def test_several_model_dirs_from_flags_env_and_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a, b = tmp_path / "cv2", tmp_path / "cv3"
    assert Settings.load(model_dir=(a, b)).model_dir == (a, b)
    assert Settings.load(model_dir=a).model_dir == (a,)  # one directory, as before
    config = tmp_path / "cosyserve.toml"
    config.write_text(f'model_dir = ["{a}", "{b}"]\n')
    assert Settings.load(config).model_dir == (a, b)
    config.write_text(f'model_dir = "{a}"\n')
    assert Settings.load(config).model_dir == (a,)
    monkeypatch.setenv("COSYSERVE_MODEL_DIR", f"{b}{os.pathsep}{a}")
    from_env = Settings.load(config)
    assert from_env.model_dir == (b, a) and from_env.first_model_dir == b
    # Workers and Ray replicas get them back as the variable writes them.
    assert from_env.to_env()["COSYSERVE_MODEL_DIR"] == f"{b}{os.pathsep}{a}"
    assert from_env.model_dump(mode="json")["model_dir"] == f"{b}{os.pathsep}{a}"
    assert Settings(**from_env.model_dump(mode="json")).model_dir == (b, a)


@pytest.mark.parametrize(
    ("dirs", "message"),
    [
        (["x/m", "x/m/"], "model directory x/m is given twice"),
        (["x/m", "y/m"], "model directories x/m and y/m have the same name 'm'"),
        ([], "at least one model directory is needed"),
    ],
)
def test_invalid_model_dirs(dirs: list[str], message: str) -> None:
    with pytest.raises(SettingsError, match=f"^invalid setting model_dir: Value error, {message}"):
        Settings.load(model_dir=[Path(d) for d in dirs])


def test_serve_takes_model_dir_repeated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a, b = tmp_path / "cv2", tmp_path / "cv3"
    a.mkdir()
    b.mkdir()
    seen: list[Settings] = []
    monkeypatch.setattr("cosyserve.server.runner.run", seen.append)
    args = ["serve", "--model-dir", str(a), "--model-dir", str(b), "--profile", "exact"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert seen[0].model_dir == (a, b)
    missing = CliRunner().invoke(app, ["serve", "--model-dir", str(a), "--model-dir", str(tmp_path / "gone")])
    assert missing.exit_code != 0 and "gone does not exist" in missing.output


def test_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "cosyserve.toml"
    config.write_text('port = 9001\nmax_active = 3\nhost = "0.0.0.0"\n')
    from_file = Settings.load(config)
    assert (from_file.port, from_file.max_active, from_file.host) == (9001, 3, "0.0.0.0")
    monkeypatch.setenv("COSYSERVE_PORT", "9002")
    from_env = Settings.load(config)
    assert (from_env.port, from_env.max_active) == (9002, 3)
    from_flag = Settings.load(config, port=9003, max_active=None)
    assert (from_flag.port, from_flag.max_active) == (9003, 3)
    monkeypatch.setenv("COSYSERVE_CONFIG", str(config))
    assert Settings.load().max_active == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"port": 70000}, "invalid setting port: Input should be less than or equal to 65535"),
        ({"workers": 0}, "invalid setting workers"),
        ({"max_queued": -1}, "invalid setting max_queued"),
        ({"log_level": "loud"}, "invalid setting log_level"),
        ({"profile": "fastest"}, "invalid setting profile: Input should be 'auto', 'fast' or 'exact'"),
        ({"flow_prompt_cache_mb": -1}, "invalid setting flow_prompt_cache_mb"),
        # The plan's fields are not settings.
        ({"flow_cache": "exact"}, "^unknown setting 'flow_cache'"),
        ({"traced_decode": False}, "^unknown setting 'traced_decode'"),
    ],
)
def test_invalid_values(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message) as info:
        Settings.load(**overrides)
    assert "\n" not in str(info.value)


def test_voices_db_is_a_path_or_a_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert Settings.load(voices_db=tmp_path / "v.db").voices_db == str(tmp_path / "v.db")
    url = "postgresql://app:pw@db:5432/voices"
    monkeypatch.setenv("COSYSERVE_VOICES_DB", url)
    settings = Settings.load()
    assert settings.voices_db == url and settings.to_env()["COSYSERVE_VOICES_DB"] == url
    with pytest.raises(SettingsError, match="invalid setting voices_db"):
        Settings.load(voices_db="")


def test_bad_config_files(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="does not exist"):
        Settings.load(tmp_path / "missing.toml")
    typo = tmp_path / "typo.toml"
    typo.write_text("prot = 1\n")
    with pytest.raises(SettingsError, match="unknown setting 'prot'"):
        Settings.load(typo)
    broken = tmp_path / "broken.toml"
    broken.write_text("port = \n")
    with pytest.raises(SettingsError, match="cannot read config file"):
        Settings.load(broken)


def test_env_round_trip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Worker processes rebuild the parent's settings from to_env()."""
    settings = Settings.load(port=9005, deadline_s=12.5, model_dir=tmp_path / "m", log_level="debug")
    for name, value in settings.to_env().items():
        monkeypatch.setenv(name, value)
    assert Settings.load().model_dump() == settings.model_dump()


def test_precision_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("PROFILE", "DTYPE", "QUANTIZE", "DEVICE", "FLOW_QUANTIZE"):
        monkeypatch.delenv(f"COSYSERVE_{name}", raising=False)
    defaults = Settings.load()
    # The auto profile, and no choice of its overridden.
    assert defaults.profile is Profile.AUTO
    assert defaults.choices() == Choices()
    config = tmp_path / "cosyserve.toml"
    config.write_text('profile = "exact"\ndtype = "bf16"\nquantize = "int8wo"\n')
    monkeypatch.setenv("COSYSERVE_QUANTIZE", "int8")
    monkeypatch.setenv("COSYSERVE_FLOW_QUANTIZE", "fp16")
    settings = Settings.load(config, device="cuda:1")
    assert settings.profile is Profile.EXACT
    assert settings.choices() == Choices(Dtype.BF16, Quantization.INT8, FlowQuantization.FP16, "cuda:1")
    # Workers get them back from the environment.
    assert settings.to_env()["COSYSERVE_DTYPE"] == "bf16"
    for name, value in settings.to_env().items():
        monkeypatch.setenv(name, value)
    assert Settings.load().model_dump() == settings.model_dump()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dtype": "fp8"}, "invalid setting dtype: Input should be 'fp32', 'bf16' or 'fp16'"),
        (
            {"quantize": "int2"},
            "invalid setting quantize: Input should be 'none', 'int8', 'int8wo' or 'int4'",
        ),
        ({"device": ""}, "invalid setting device"),
        ({"flow_quantize": "int8"}, "invalid setting flow_quantize: Input should be 'none' or 'fp16'"),
    ],
)
def test_invalid_precision_settings(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.load(**overrides)
