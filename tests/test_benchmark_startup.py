"""``benchmarks/startup.py``: it times ``serve`` to ``/ready`` with the phases it logs,
cold and then warm from the traces the first start kept, and stops the server."""

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture
def startup(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when it runs as a script
    return importlib.import_module("startup")


def test_startup_times_a_cold_and_a_warm_start(
    startup: ModuleType, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    command = [sys.executable, str(BENCHMARKS / "startup.py"), "--model-dir", str(tiny_model_dir)]
    command += ["--starts", "2", "--json", str(out), "--max-active", "2"]
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["serve_flags"] == ["--max-active", "2"]
    cold, warm = report["runs"]
    assert (cold["start"], warm["start"]) == ("cold", "warm")
    for run in (cold, warm):
        phases = run["phases_s"]
        assert list(phases) == [name for name, _ in startup.PHASES]  # each one logged
        assert 0 < phases["load"] < run["wall_to_ready_s"]
    # Whether the warm start's traces came from the cold start's files is tested without
    # timing (tests/models/test_trace_cache.py); on the tiny model both take milliseconds,
    # and which is shorter depends on the machine's load.


def test_phases_are_stated_or_the_time_between_lines(startup: ModuleType) -> None:
    lines = [
        (2.0, "HTTP listening on http://127.0.0.1:8123"),
        (9.0, "loaded /m, fp32/none on cpu (lm float32), in 5.5 s"),
        (12.5, "captured 2 decode steps for replay"),  # a server that does not say how long
        (20.0, "flow steps traced for replay in 7.0 s"),
        (21.0, "warm-up done: 8640 samples in 0.9 s"),
        (21.1, "ready: model /m, started in 19.0 s"),
    ]
    phases = startup.phases(lines)
    assert phases == {
        "listening": 2.0,
        "load": 5.5,
        "decode traces": 3.5,
        "flow traces": 7.0,
        "warm-up": 0.9,
        "ready": 0.1,
    }


def test_a_server_that_cannot_start_fails_the_script(tmp_path: Path) -> None:
    command = [sys.executable, str(BENCHMARKS / "startup.py"), "--model-dir", str(tmp_path / "none")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "the server exited" in done.stderr
