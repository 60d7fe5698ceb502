"""``download`` against a loopback fake of the Hugging Face Hub.

The fake repository has the official layout with random bytes (only the layout is read
after a download); ``llm.pt`` is larger than huggingface_hub's 10 MB read size, so a
transfer cut after 25 MB has complete blocks to resume from.
"""

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants
from typer.testing import CliRunner

from cosyserve.cli.main import app
from cosyserve.frontend.text_tokenizer import MERGES_FILE, TOKENIZER_CONFIG_FILE, VOCAB_FILE
from cosyserve.modeldir.download import REPOS, DownloadError, Source, download
from cosyserve.modeldir.family import (
    CAMPPLUS_FILE,
    FLOW_FILE,
    HIFT_FILE,
    LLM_FILE,
    SPEECH_TOKENIZER_FILE,
    YAML_FILE,
    Family,
)
from cosyserve.modeldir.layout import MANIFEST_FILE, QWEN_CONFIG_FILE, QWEN_DIR
from cosyserve.modeldir.manifest import check_manifest, read_manifest, sha256_file
from tests.modeldir.fake_hub import COMMIT, HubState, fake_hub

REPO = REPOS[Family.COSYVOICE2, Source.HUGGINGFACE]
USED = {
    LLM_FILE: 25 << 20,
    FLOW_FILE: 300_000,
    HIFT_FILE: 200_000,
    CAMPPLUS_FILE: 120_000,
    SPEECH_TOKENIZER_FILE: 120_000,
    YAML_FILE: 2_000,
    **{
        f"{QWEN_DIR}/{name}": 1_000
        for name in (QWEN_CONFIG_FILE, VOCAB_FILE, MERGES_FILE, TOKENIZER_CONFIG_FILE)
    },
}
# In the official snapshot but not read by cosyserve: fetched only with everything=True.
UNUSED = {
    "README.md": 1_000,
    "flow.decoder.estimator.fp32.onnx": 150_000,
    f"{QWEN_DIR}/model.safetensors": 200_000,
}


@pytest.fixture(scope="module")
def repo_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("repo")
    files = {}
    for name, size in {**USED, **UNUSED}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        files[name] = path
    return files


@pytest.fixture
def hub(repo_files: dict[str, Path]) -> Iterator[tuple[str, HubState]]:
    with fake_hub(REPO, repo_files) as served:
        yield served


def fetch(hub: tuple[str, HubState], target: Path, **kwargs: object) -> object:
    return download(target, endpoint=hub[0], hf_cache_dir=target.parent / "hf-cache", **kwargs)  # type: ignore[arg-type]


def test_snapshot_is_complete_checked_and_has_a_manifest(
    hub: tuple[str, HubState], repo_files: dict[str, Path], tmp_path: Path
) -> None:
    target = tmp_path / "model"
    result = fetch(hub, target)
    expected = {name: sha256_file(repo_files[name]) for name in USED}
    assert read_manifest(target) == expected  # the same bytes as the served files
    assert check_manifest(target) == []
    assert (target / ".cache").is_dir()  # huggingface_hub's state: not in the manifest
    assert not any((target / name).exists() for name in UNUSED)
    assert result.commit is not None and result.files == len(expected) and result.local_only == ()  # type: ignore[attr-defined]


def test_everything_fetches_the_whole_snapshot(hub: tuple[str, HubState], tmp_path: Path) -> None:
    target = tmp_path / "model"
    fetch(hub, target, everything=True)
    assert set(read_manifest(target)) == set(hub[1].files)


def test_cut_transfer_resumes_with_a_range_request(hub: tuple[str, HubState], tmp_path: Path) -> None:
    state = hub[1]
    state.cut_once[LLM_FILE] = 25_000_000
    target = tmp_path / "model"
    fetch(hub, target)
    first, resumed = state.gets(LLM_FILE)
    assert first is None
    assert resumed is not None and resumed.startswith("bytes=") and 0 < int(resumed[6:-1]) <= 25_000_000
    assert check_manifest(target) == []


def test_failed_download_is_resumed_by_running_it_again(hub: tuple[str, HubState], tmp_path: Path) -> None:
    state = hub[1]
    state.fail.add(FLOW_FILE)
    target = tmp_path / "model"
    with pytest.raises(DownloadError, match=r"run the same command again to resume"):
        fetch(hub, target)
    assert not (target / MANIFEST_FILE).exists()
    assert len(state.gets(LLM_FILE)) == 1
    state.fail.clear()
    fetch(hub, target)
    assert len(state.gets(LLM_FILE)) == 1  # kept from the first run, not fetched again
    assert len(state.gets(FLOW_FILE)) == 2
    assert check_manifest(target) == []


def test_file_corrupted_in_transit_is_named_and_deleted(hub: tuple[str, HubState], tmp_path: Path) -> None:
    state = hub[1]
    state.corrupt.add(HIFT_FILE)
    target = tmp_path / "model"
    with pytest.raises(DownloadError, match=r"^hift\.pt: checksum differs from the hub's \(deleted\)"):
        fetch(hub, target)
    assert not (target / HIFT_FILE).exists()
    state.corrupt.clear()
    fetch(hub, target)
    assert check_manifest(target) == []


def test_unreachable_hub_is_one_actionable_error(tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match=r"download from .* failed .*run the same command again"):
        download(tmp_path / "model", endpoint="http://127.0.0.1:9", hf_cache_dir=tmp_path / "hf")


def test_modelscope_without_its_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "modelscope", None)  # as if not installed
    with pytest.raises(DownloadError, match=r"needs modelscope: pip install 'cosyserve\[download\]'"):
        download(tmp_path / "model", Source.MODELSCOPE)


def test_download_command(hub: tuple[str, HubState], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    target = tmp_path / "model"
    result = CliRunner().invoke(app, ["download", "--dir", str(target), "--endpoint", hub[0]])
    assert result.exit_code == 0, result.output
    assert f"{REPO}@{COMMIT[:12]}: {len(USED)} files" in result.stdout
    assert f"serve it with: cosyserve serve --model-dir {target}" in result.stdout
    assert CliRunner().invoke(app, ["verify", str(target)]).exit_code == 0
    hub[1].fail.add(LLM_FILE)
    failed = CliRunner().invoke(app, ["download", "--dir", str(tmp_path / "other"), "--endpoint", hub[0]])
    assert failed.exit_code == 2 and failed.stderr.splitlines()[-1].startswith("error: download from ")


def test_cosyvoice3_snapshot_with_its_rl_lm(tmp_path: Path) -> None:
    """Fun-CosyVoice3-0.5B-2512: its own yaml and speech tokenizer, and the RL-tuned LM."""
    root = tmp_path / "repo3"
    used = {name: size for name, size in USED.items() if name not in (YAML_FILE, SPEECH_TOKENIZER_FILE)} | {
        "cosyvoice3.yaml": 2_000,
        "speech_tokenizer_v3.onnx": 120_000,
        "llm.rl.pt": 1 << 20,
    }
    files = {}
    for name, size in {**used, **UNUSED}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
        files[name] = path
    with fake_hub(REPOS[Family.COSYVOICE3, Source.HUGGINGFACE], files) as served:
        target = tmp_path / "model3"
        result = fetch(served, target, family="cosyvoice3")
    assert set(read_manifest(target)) == set(used)
    assert result.repo == "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"  # type: ignore[attr-defined]
