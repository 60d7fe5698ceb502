"""``benchmarks/common.py``: worker processes run their steps one at a time, in turn; and
``benchmarks/upstream_engine.py`` runs both sides that way, on a CosyVoice 2 directory; on
a CosyVoice 3 one (whose upstream, a checkout, CI does not have) it runs our side alone and
says what upstream's side needs."""

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from cosyserve.frontend.text_tokenizer import ENDOFPROMPT_ID
from cosyserve.modeldir.family import Family
from cosyserve.modeldir.layout import ModelDir
from cosyserve.pipeline.llm_prompt import system_prompt

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"

# A worker of ``steps`` steps that logs when each starts and ends, noise on stdout included.
WORKER = """
import json, sys, time
sys.path.insert(0, sys.argv[4])
from common import Turns
name, steps, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
turns = Turns(True)
for step in range(steps):
    turns.wait()
    print("a line of the worker's own")
    with open(log, "a") as f:
        f.write(f"{name} {step} start\\n")
    time.sleep(0.05)
    with open(log, "a") as f:
        f.write(f"{name} {step} end\\n")
print(json.dumps({"worker": name}))
"""


@pytest.fixture
def turns(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when the benchmarks run as scripts
    return importlib.import_module("common")


def _worker(name: str, steps: int, log: Path) -> list[str]:
    return [sys.executable, "-c", WORKER, name, str(steps), str(log), str(BENCHMARKS)]


def test_workers_run_each_step_alone_and_in_turn(turns: ModuleType, tmp_path: Path) -> None:
    log = tmp_path / "log"
    reports = turns.take_turns({"a": _worker("a", 3, log), "b": _worker("b", 3, log)}, steps=3)
    assert {name: json.loads(line) for name, line in reports.items()} == {
        "a": {"worker": "a"},
        "b": {"worker": "b"},
    }
    expected = [f"{name} {step} {edge}" for step in range(3) for name in "ab" for edge in ("start", "end")]
    assert log.read_text().splitlines() == expected


def test_a_worker_that_ends_early_fails_the_run_and_none_is_left(turns: ModuleType, tmp_path: Path) -> None:
    log = tmp_path / "log"
    workers = {"a": _worker("a", 3, log), "short": _worker("short", 1, log)}
    with pytest.raises(RuntimeError, match="short ended before its turn"):
        turns.take_turns(workers, steps=3)
    assert _processes_naming(log) == []


def _processes_naming(path: Path) -> list[int]:
    """The processes whose command line names ``path``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(path).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:  # gone meanwhile
            continue
    return found


def test_upstream_engine_interleaves_the_two_sides(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    command = [sys.executable, str(BENCHMARKS / "upstream_engine.py"), "--model-dir", str(tiny_model_dir)]
    command += [
        "--tokens",
        "10",
        "--streams",
        "2",
        "--repeats",
        "2",
        "--prompt-seconds",
        "1",
        "--json",
        str(out),
    ]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    singles = [line.split("] ", 1)[1] for line in done.stderr.splitlines() if "streaming, " in line]
    kinds = [f"{kind}, {n} of 2" for kind in ("non-streaming", "streaming") for n in (1, 2)]
    assert singles == [f"{side}: {kind}" for kind in kinds for side in ("upstream", "ours")]
    reports = json.loads(out.read_text())["reports"]
    for side in ("upstream", "ours"):
        assert len(reports[side]["non_stream_runs_s"]) == 2 and reports[side]["streams_audio_s_per_s"] > 0


@pytest.mark.slow  # the same script as the test above, by its other, simpler schedule
def test_upstream_engine_without_interleave_runs_one_side_after_the_other(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    command = [sys.executable, str(BENCHMARKS / "upstream_engine.py"), "--model-dir", str(tiny_model_dir)]
    command += ["--tokens", "10", "--streams", "2", "--repeats", "1", "--prompt-seconds", "1"]
    command += ["--no-interleave", "--json", str(out)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    progress = [line.split("] ", 1)[1] for line in done.stderr.splitlines() if "streaming, " in line]
    sides = [line.split(":")[0] for line in progress]
    assert sides == ["upstream", "upstream", "ours", "ours"]
    reports = json.loads(out.read_text())["reports"]
    for side in ("upstream", "ours"):
        assert len(reports[side]["load_average_before"]) == 3
        assert reports[side]["non_stream_runs_s"] and reports[side]["streams_audio_s_per_s"] > 0


# -- upstream_engine.py on a CosyVoice 3 directory (upstream's side needs the checkout) ------


@pytest.fixture
def upstream_engine(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when the benchmarks run as scripts
    return importlib.import_module("upstream_engine")


def _without_upstream3() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("COSYVOICE3_UPSTREAM", "COSYVOICE3_SITE")}


def test_upstream_engine_gives_cosyvoice3_its_prompt_marker_on_both_sides(
    upstream_engine: ModuleType, tiny_model_dir: Path, tiny3_model_dir: Path
) -> None:
    args = argparse.Namespace(prompt_seconds=1.0, seed=0, repeats=1, streams=2, bursts=1, tokens=10)
    voice2, texts2, _ = upstream_engine.workload(tiny_model_dir, args)
    voice3, texts3, rate3 = upstream_engine.workload(tiny3_model_dir, args)
    head = tuple(ModelDir.open(tiny3_model_dir).text_tokenizer().encode(system_prompt()))
    assert head[-1] == ENDOFPROMPT_ID  # upstream's CosyVoice 3 LM asserts it is in the prompt
    assert voice3.prompt_text_ids == head + voice2.prompt_text_ids  # then the same transcript
    assert ENDOFPROMPT_ID not in voice2.prompt_text_ids
    assert texts3 == texts2 and rate3 == 24000


def test_upstream_engine_knows_what_each_family_needs_of_upstream(
    upstream_engine: ModuleType, tmp_path: Path
) -> None:
    models = importlib.import_module("upstream_models")  # benchmarks/upstream_models.py
    assert models.upstream_unavailable(Family.COSYVOICE2, {}) is None
    unset = models.upstream_unavailable(Family.COSYVOICE3, {})
    assert "COSYVOICE3_UPSTREAM" in unset and "COSYVOICE3_SITE" in unset and "not set" in unset
    environ = {"COSYVOICE3_UPSTREAM": str(tmp_path), "COSYVOICE3_SITE": str(tmp_path / "nowhere")}
    assert f"not a directory: COSYVOICE3_SITE={tmp_path / 'nowhere'}" in models.upstream_unavailable(
        Family.COSYVOICE3, environ
    )
    environ["COSYVOICE3_SITE"] = str(tmp_path)
    assert models.upstream_unavailable(Family.COSYVOICE3, environ) is None


def test_upstream_engine_on_cosyvoice3_names_the_variables_upstream_needs(tiny3_model_dir: Path) -> None:
    command = [sys.executable, str(BENCHMARKS / "upstream_engine.py"), "--model-dir", str(tiny3_model_dir)]
    done = subprocess.run(command, capture_output=True, text=True, env=_without_upstream3())
    assert done.returncode == 2  # before any worker starts
    assert "CosyVoice 3" in done.stderr
    assert "COSYVOICE3_UPSTREAM" in done.stderr and "COSYVOICE3_SITE" in done.stderr


def test_upstream_engine_runs_our_side_alone_on_cosyvoice3(tiny3_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    command = [sys.executable, str(BENCHMARKS / "upstream_engine.py"), "--model-dir", str(tiny3_model_dir)]
    command += ["--sides", "ours", "--tokens", "10", "--streams", "2", "--repeats", "1"]
    command += ["--prompt-seconds", "1", "--json", str(out)]
    subprocess.run(command, check=True, capture_output=True, text=True, env=_without_upstream3())
    summary = json.loads(out.read_text())
    assert summary["family"] == "cosyvoice3" and list(summary["reports"]) == ["ours"]
    ours = summary["reports"]["ours"]
    assert ours["audio_s"] == pytest.approx(10 / 25) and ours["streams_audio_s_per_s"] > 0
