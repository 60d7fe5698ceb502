"""The CPU image built from docker/Dockerfile and run with podman (slow: minutes).

What differs from a user's `docker build`, and why: Docker Hub cannot be reached here, so
the base is Debian 12 (Python 3.11) made with debootstrap and imported into podman,
given as PYTHON_IMAGE; download.pytorch.org cannot be reached either, so torch 2.13.0's
CPU wheel comes from the local wheel folder (PIP_FIND_LINKS) through a pip.conf mounted
into the build. On this sandbox podman runs with runc (crun refuses the hybrid cgroup
layout), host networking, and resource limits no higher than the current ones (the
sandbox lacks CAP_SYS_RESOURCE). Then the container serves the tiny model as the image's
user with the `auto` profile, its HEALTHCHECK passes, it synthesises, and `podman stop`
drains it to exit status 0.

Needs the Debian packages podman, runc and debootstrap (scripts/install installs them); CI
runs it in a step of its own (.ci/run). Skipped, with podman's answer, where podman cannot
start a container. The base image is kept between runs (debootstrap takes minutes), and so
are the build's layers.
"""

import os
import resource
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.deploy.tooling import ROOT

pytestmark = pytest.mark.slow

BASE_IMAGE = "localhost/cosyserve-test-base:bookworm"
IMAGE = "localhost/cosyserve-test:cpu"
BUILD_TIMEOUT_S = 1800
READY_TIMEOUT_S = 300
# The image's stop grace for the drain (compose's stop_grace_period).
STOP_TIMEOUT_S = 45


def _require(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (apt-get install podman runc debootstrap)")


def _torch_wheels() -> Path:
    for folder in os.environ.get("PIP_FIND_LINKS", "").split():
        if any(Path(folder).glob("torch-2.13.0+cpu-cp311-*.whl")):
            return Path(folder)
    pytest.skip("no local torch 2.13.0 CPU wheel on PIP_FIND_LINKS, and download.pytorch.org is unreachable")


def _limits() -> list[str]:
    """--ulimit flags no higher than the current soft limits: raising one needs
    CAP_SYS_RESOURCE. This sandbox also refuses an nproc above kernel.pid_max."""
    nofile, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nproc = pid_max if nproc == resource.RLIM_INFINITY else min(nproc, pid_max)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def _podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        ["podman", "--runtime", "runc", *args], capture_output=True, text=True, timeout=timeout
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"podman {' '.join(args[:2])} failed ({result.returncode}):\n{result.stderr[-4000:]}"
        )
    return result


def _base_image(tmp: Path) -> str:
    """Debian 12 with Python 3.11, venv and headers: what python:3.11-slim provides."""
    if _podman("image", "exists", BASE_IMAGE, check=False).returncode == 0:
        return BASE_IMAGE
    rootfs = tmp / "rootfs"
    packages = "python3,python3-venv,python3-dev,python-is-python3,ca-certificates"
    subprocess.run(
        ["debootstrap", "--variant=minbase", f"--include={packages}", "bookworm", str(rootfs)],
        check=True,
        capture_output=True,
        timeout=BUILD_TIMEOUT_S,
    )
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["podman", "import", "-", BASE_IMAGE], stdin=tar.stdout, check=True, capture_output=True)
    assert tar.wait() == 0
    return BASE_IMAGE


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    _require("podman", "runc", "debootstrap")
    wheels = _torch_wheels()
    tmp = tmp_path_factory.mktemp("image")
    base = _base_image(tmp)
    # An engine that cannot start a container here (no runtime it can use, limits it may not
    # set) is a fact about the machine, not about the image: say what it answered.
    probe = _podman("run", "--rm", "--network", "host", *_limits(), base, "true", check=False)
    if probe.returncode != 0:
        pytest.skip(f"podman cannot run a container here: {probe.stderr.strip()[-500:]}")
    pip_conf = tmp / "pip.conf"
    # The host's CA bundle: its egress may re-sign TLS with a CA of its own.
    pip_conf.write_text("[global]\nfind-links = /opt/torch-wheels\ncert = /etc/ssl/host-ca.crt\n")
    _podman(
        "build",
        "--format",
        "docker",  # OCI images drop HEALTHCHECK
        "--network",
        "host",
        *_limits(),
        "--volume",
        f"{wheels}:/opt/torch-wheels:ro",
        "--volume",
        f"{pip_conf}:/etc/pip.conf:ro",
        "--volume",
        "/etc/ssl/certs/ca-certificates.crt:/etc/ssl/host-ca.crt:ro",
        "--build-arg",
        f"PYTHON_IMAGE={base}",
        "--build-arg",
        "TORCH_INDEX=https://pypi.org/simple",
        "-f",
        str(ROOT / "docker" / "Dockerfile"),
        "-t",
        IMAGE,
        str(ROOT),
        timeout=BUILD_TIMEOUT_S,
    )
    return IMAGE


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def container(image: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The image serving a copy of the tiny model (readable by the image's user); removed after."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    subprocess.run(["chmod", "-R", "a+rX", str(model)], check=True)
    name = f"cosyserve-test-{os.getpid()}"
    port = _free_port()
    _podman(
        "run",
        "-d",
        "--name",
        name,
        "--network",
        "host",
        *_limits(),
        "-e",
        f"COSYSERVE_PORT={port}",
        "-e",
        "COSYSERVE_GRPC_PORT=0",
        "-e",
        "COSYSERVE_AUTH_MODE=none",
        "-v",
        f"{model}:/models/CosyVoice2-0.5B:ro",
        image,
    )
    try:
        yield name, f"http://127.0.0.1:{port}"
    finally:
        _podman("rm", "-f", "-v", name, check=False)


def _wait_ready(name: str, url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        state = _podman("inspect", name, "--format", "{{.State.Status}}").stdout.strip()
        assert state == "running", _podman("logs", name).stderr[-4000:]
        time.sleep(1)
    raise AssertionError(f"not ready in {READY_TIMEOUT_S} s:\n{_podman('logs', name).stderr[-4000:]}")


def test_image_serves_checks_health_and_drains(container: tuple[str, str]) -> None:
    name, url = container
    _wait_ready(name, url)
    assert _podman("exec", name, "id", "-u").stdout.strip() == "10001"
    assert _podman("healthcheck", "run", name, check=False).returncode == 0
    plan = httpx.get(f"{url}/health", timeout=10).json()["plan"]
    assert plan["profile"] == "auto"
    response = httpx.get(
        f"{url}/tts",
        params={"text": "Hi.", "voice": "英文男", "min_tokens": 10, "max_tokens": 10, "seed": 1},
        timeout=120,
    )
    assert response.status_code == 200 and response.content[:4] == b"RIFF"
    _podman("stop", "-t", str(STOP_TIMEOUT_S), name, timeout=STOP_TIMEOUT_S + 30)
    assert _podman("inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip() == "0"
    logs = _podman("logs", name)
    assert "draining" in logs.stdout + logs.stderr
