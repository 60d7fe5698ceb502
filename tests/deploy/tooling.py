"""What the deployment tests share: the repository root, the tools the dev extra installs
into the virtual environment, and which paths the server's app serves."""

import sys
from functools import cache
from pathlib import Path

from fastapi.testclient import TestClient

from cosyserve.server.http.app import create_app
from cosyserve.server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def venv_tool(name: str) -> str:
    """A command installed next to this interpreter (hadolint, kubectl: the dev extra)."""
    path = Path(sys.executable).with_name(name)
    assert path.exists(), f"{path} is missing: bash scripts/install installs it (the dev extra)"
    return str(path)


@cache
def served(path: str) -> bool:
    """Whether the server's app routes GET ``path`` (asked of the app itself, not started:
    no model is loaded, so /ready answers 503; an unknown path is 404)."""
    client = TestClient(create_app(Settings.load(auth_mode="none")))
    return client.get(path).status_code != 404
