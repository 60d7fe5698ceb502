"""The container image and the compose stack: hadolint, what the image is configured to
do, its entry point and health check run for real against a server, and compose.yaml with
the Prometheus and Grafana files it mounts.

No container engine runs in the default suite; ``test_image.py`` builds and runs the
image with podman (slow).
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from cosyserve.server.runner import _BACKSTOP_S
from cosyserve.server.settings import ENV_PREFIX, Settings
from tests.deploy.dockerfile import Dockerfile, exec_form, split_options
from tests.deploy.tooling import ROOT, served, venv_tool
from tests.server.conftest import (
    STOP_TIMEOUT_S,
    ServerProcess,
    _wait_listening,
    _wait_ready,
    isolated_env,
    server_args,
    stop_server,
)

DOCKERFILE = ROOT / "docker" / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
COMPOSE = ROOT / "compose.yaml"
TARGETS = ("cpu", "cuda")


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return Dockerfile.read(DOCKERFILE)


def _setting(variable: str) -> str:
    assert variable.startswith(ENV_PREFIX), variable
    name = variable.removeprefix(ENV_PREFIX).lower()
    assert name in Settings.model_fields, f"{variable} is no setting"
    return name


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", value)
    assert match, f"not a duration: {value}"
    return float(match[1]) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match[2]]


def _drain_bound_s(env: dict[str, str]) -> float:
    """How long a stopping server may take: the grace period, then uvicorn's backstop."""
    grace = float(env.get("COSYSERVE_SHUTDOWN_GRACE_S", Settings.model_fields["shutdown_grace_s"].default))
    return grace + _BACKSTOP_S


# -- the Dockerfile ------------------------------------------------------------------------


def _hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([venv_tool("hadolint"), str(path)], capture_output=True, text=True, timeout=60)


def test_hadolint_passes() -> None:
    result = _hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_refuse_a_root_image(tmp_path: Path) -> None:
    root = tmp_path / "Dockerfile"
    root.write_text(DOCKERFILE.read_text() + "USER root\n")
    result = _hadolint(root)
    assert result.returncode != 0 and "DL3002" in result.stdout


def test_default_target_is_the_cpu_image(dockerfile: Dockerfile) -> None:
    assert dockerfile.stages[-1].name == "cpu"
    # The images are built FROM the venv stages of their own kind only.
    for target in TARGETS:
        copied = [args for args in dockerfile.stage(target).all("COPY") if args.startswith("--from=")]
        assert copied == [f"--from=venv-{target} /opt/venv /opt/venv"]
    assert "download.pytorch.org/whl/cpu" in (dockerfile.stage("venv-cpu").all("ARG")[0])


@pytest.mark.parametrize("target", TARGETS)
def test_image_runs_unprivileged_with_the_auto_profile(dockerfile: Dockerfile, target: str) -> None:
    user = dockerfile.effective(target, "USER")
    assert user is not None and re.fullmatch(r"[1-9]\d*:[1-9]\d*", user), user  # numeric: runAsNonRoot
    env = dockerfile.effective_env(target)
    assert env["COSYSERVE_PROFILE"] == "auto"
    assert env["COSYSERVE_HOST"] == "0.0.0.0"
    settings = {_setting(name): value for name, value in env.items() if name.startswith(ENV_PREFIX)}
    Settings(**settings)  # valid values
    expose = {int(port) for port in (dockerfile.effective(target, "EXPOSE") or "").split()}
    assert expose == {int(settings["port"]), int(settings["grpc_port"])}
    volumes = set(exec_form(dockerfile.effective(target, "VOLUME") or "[]"))
    assert volumes == {"/models", "/cache"}
    assert Path(settings["model_dir"]).parent == Path("/models")
    assert env["XDG_CACHE_HOME"] == "/cache" and env["TORCH_EXTENSIONS_DIR"].startswith("/cache/")


@pytest.mark.parametrize("target", TARGETS)
def test_entrypoint_and_healthcheck(dockerfile: Dockerfile, target: str) -> None:
    entrypoint = exec_form(dockerfile.effective(target, "ENTRYPOINT") or "")
    assert f"docker/entrypoint.sh /usr/local/bin/{entrypoint[0]}" in dockerfile.stage("runtime").all("COPY")
    assert exec_form(dockerfile.effective(target, "CMD") or "") == ["serve"]
    assert dockerfile.effective(target, "STOPSIGNAL") == "SIGTERM"
    options, command = split_options(dockerfile.effective(target, "HEALTHCHECK") or "")
    assert _seconds(options["timeout"]) < _seconds(options["interval"])
    assert command.startswith("CMD ")
    probe = exec_form(command.removeprefix("CMD "))
    path = re.search(r"/\w+(?=')", probe[-1])
    assert path and path[0] == "/ready" and served(path[0])


def test_entrypoint_is_executable() -> None:
    assert os.access(ENTRYPOINT, os.X_OK)
    result = subprocess.run(["sh", "-n", str(ENTRYPOINT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _entrypoint_env(tmp: Path, model_dir: Path, **extra: str) -> dict[str, str]:
    env = isolated_env(tmp)
    # The venv's bin on PATH, as /opt/venv/bin in the image.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update({"COSYSERVE_MODEL_DIR": str(model_dir), "FETCH_MODEL": "missing", **extra})
    return env


def _healthcheck(dockerfile: Dockerfile, port: int) -> subprocess.CompletedProcess[str]:
    """The image's HEALTHCHECK command, run by this interpreter."""
    _, command = split_options(dockerfile.effective("cpu", "HEALTHCHECK") or "")
    probe = exec_form(command.removeprefix("CMD "))
    env = {**os.environ, "COSYSERVE_PORT": str(port)}
    return subprocess.run([sys.executable, *probe[1:]], env=env, capture_output=True, text=True, timeout=30)


def test_entrypoint_serves_a_present_model_and_sigterm_drains(
    dockerfile: Dockerfile, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """With a manifest in the model directory nothing is fetched; the entry point execs the
    server (same process), the health check passes, and SIGTERM to that process drains."""
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(ENTRYPOINT), "serve", *server_args(tiny_model_dir, tmp_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_entrypoint_env(tmp_path, tiny_model_dir),
        )
    try:
        server = ServerProcess(_wait_listening(process, log_path), process, log_path)
        _wait_ready(server)
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().split(b"\0")
        assert b"serve" in cmdline and not any(part.endswith(b"entrypoint.sh") for part in cmdline)
        port = int(server.url.rsplit(":", 1)[1])
        assert _healthcheck(dockerfile, port).returncode == 0
        process.send_signal(signal.SIGTERM)
        assert process.wait(STOP_TIMEOUT_S) == 0
        assert "draining" in server.log()
        assert "fetching" not in server.log()
        assert _healthcheck(dockerfile, port).returncode != 0
    finally:
        stop_server(process)


def test_entrypoint_fetches_a_missing_model_before_serving(tmp_path: Path) -> None:
    """An empty model volume: `cosyserve download` runs first, and its failure (no hub
    reachable here) stops the start instead of starting a server without weights."""
    empty = tmp_path / "models" / "CosyVoice2-0.5B"
    env = _entrypoint_env(tmp_path, empty, HF_ENDPOINT="http://127.0.0.1:9")
    result = subprocess.run(
        [str(ENTRYPOINT), "serve", "--port", "0"], env=env, capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert f"no model in {empty}: fetching it" in output
    assert "download from FunAudioLLM/CosyVoice2-0.5B failed" in output
    assert "HTTP listening" not in output


def test_entrypoint_refuses_an_unknown_fetch_mode(tmp_path: Path) -> None:
    env = _entrypoint_env(tmp_path, tmp_path, FETCH_MODEL="always")
    result = subprocess.run([str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "FETCH_MODEL must be missing or never, not 'always'" in result.stderr


# -- compose.yaml, Prometheus, Grafana -------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """A service's mounts: target -> source."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        mounts[target] = source
    return mounts


def test_compose_builds_and_runs_the_image(compose: dict[str, Any], dockerfile: Dockerfile) -> None:
    assert set(compose["services"]) == {"cosyserve", "prometheus", "grafana"}
    service = compose["services"]["cosyserve"]
    assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert service["build"]["target"] in TARGETS
    assert service["init"] is True  # an init process reaps and forwards signals
    env = {**dockerfile.effective_env(service["build"]["target"]), **service["environment"]}
    for name in service["environment"]:
        _setting(name)
    published = {int(port.rsplit(":", 1)[1]) for port in service["ports"]}
    assert published == {int(env["COSYSERVE_PORT"]), int(env["COSYSERVE_GRPC_PORT"])}
    assert set(_mounts(service)) == set(exec_form(dockerfile.effective("cpu", "VOLUME") or "[]"))
    # The API keys file is a secret of the service.
    keys = env["COSYSERVE_AUTH_API_KEYS"]
    assert keys.startswith("@/run/secrets/") and keys.removeprefix("@/run/secrets/") in service["secrets"]
    assert _seconds(service["stop_grace_period"]) > _drain_bound_s(env)


def test_compose_gpu_file_selects_the_cuda_image() -> None:
    gpu = yaml.safe_load((ROOT / "compose.gpu.yaml").read_text())["services"]["cosyserve"]
    assert gpu["build"]["target"] == "cuda"
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_compose_mounts_files_that_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for source in _mounts(service).values():
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
    for secret in compose["secrets"].values():
        # Made by hand (docs/deploy.md): their folder is there, with a .gitignore.
        folder = (ROOT / secret["file"]).parent
        assert (folder / ".gitignore").read_text().splitlines()[-2:] == ["*", "!.gitignore"]


def test_prometheus_scrapes_the_metrics_route(compose: dict[str, Any]) -> None:
    service = compose["services"]["prometheus"]
    config_path = next(s for t, s in _mounts(service).items() if t == "/etc/prometheus/prometheus.yml")
    config = yaml.safe_load((ROOT / config_path).read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and served("/metrics")
    (target,) = job["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host == "cosyserve" and int(port) == Settings.model_fields["port"].default
    credentials = job["authorization"]["credentials_file"]
    assert credentials.startswith("/run/secrets/")
    assert credentials.removeprefix("/run/secrets/") in service["secrets"]


def test_grafana_provisions_the_datasource_and_dashboard(compose: dict[str, Any]) -> None:
    service = compose["services"]["grafana"]
    mounts = _mounts(service)
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "cosyserve.yaml").read_text())["providers"]
    dashboards_in_container = provider["options"]["path"]
    dashboards = ROOT / mounts[dashboards_in_container]
    home = Path(service["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home.parent == Path(dashboards_in_container) and (dashboards / home.name).is_file()
    dashboard = json.loads((dashboards / home.name).read_text())
    sources = {
        target["datasource"]["uid"] for panel in dashboard["panels"] for target in panel["targets"]
    } | {panel["datasource"]["uid"] for panel in dashboard["panels"]}
    assert sources == {datasource["uid"]}
