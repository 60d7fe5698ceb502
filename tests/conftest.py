"""Fixtures and options shared by the whole suite."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cosyserve.modeldir.presets import TINY
from cosyserve.models.generate import init_model_dir
from cosyserve.models.lm import CosyVoice2LM
from cosyserve.weights.randomize import randomize_
from tests.postgres import PostgresMissingError, PostgresServer, server_binaries, throwaway_postgres


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run tests marked slow (full-size geometry)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Slow tests run only when asked for, by --slow or by a -m expression naming them.
    if config.getoption("--slow") or "slow" in config.getoption("-m", ""):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow or -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """cosyserve's cache directory (``cosyserve.paths.cache_dir``: the traces a server
    keeps, ...) in a temporary directory, never the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache-home")))
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete tiny CosyVoice2 model directory (random weights, seed 0), built once per
    session. Treat it as read-only: a test that needs a modified directory builds its own
    (``tests/modeldir/test_layout.py`` has a cheap symlinked view)."""
    path = tmp_path_factory.mktemp("models") / "tiny"
    init_model_dir(path, "tiny", seed=0)
    return path


@pytest.fixture(scope="session")
def tiny3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete tiny Fun-CosyVoice3 model directory (random weights, seed 0, with an
    RL-tuned LM file), built once per session; read-only as ``tiny_model_dir``."""
    path = tmp_path_factory.mktemp("models") / "tiny3"
    init_model_dir(path, "tiny", seed=0, family="cosyvoice3", rl_lm=True)
    return path


@pytest.fixture(scope="module")
def lm() -> CosyVoice2LM:
    """The tiny preset's LM with random weights (seed 0), in eval mode: one per test module,
    so a module that changes it leaves the others' alone."""
    model = CosyVoice2LM(TINY.lm)
    randomize_(model, torch.Generator().manual_seed(0))
    return model.eval()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL server (tests/postgres.py), started once per session when a
    test first asks for it, stopped at the end. Missing binaries fail the test: run
    scripts/install."""
    try:
        binaries = server_binaries()
    except PostgresMissingError as exc:
        pytest.fail(str(exc), pytrace=False)
    with throwaway_postgres(binaries) as server:
        yield server


@pytest.fixture(scope="session")
def postgres_url(postgres: PostgresServer) -> str:
    """A ``postgresql://`` URL (with a password) of a database made for the session; a test
    that needs an empty one of its own takes ``postgres.new_database()``."""
    return postgres.new_database()
