"""What ``serve`` checks before loading: a missing directory names the command that
fetches it; a tampered, truncated or unlisted file stops the start in one line."""

import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cosyserve.errors import ModelDirError
from cosyserve.modeldir.family import HIFT_FILE, LLM_FILE
from cosyserve.modeldir.layout import MANIFEST_FILE
from cosyserve.modeldir.manifest import manifest_digest
from cosyserve.modeldir.preflight import check_model_dir
from cosyserve.paths import MODEL_DIR_ENV
from cosyserve.server.http.app import create_app
from cosyserve.server.runtime import Phase
from cosyserve.server.settings import Settings


def view(src: Path, dst: Path, replace: dict[str, bytes] | None = None) -> Path:
    """Symlinks to every entry of ``src`` except the files in ``replace``, written anew."""
    dst.mkdir()
    replace = replace or {}
    for entry in src.iterdir():
        if entry.name not in replace:
            (dst / entry.name).symlink_to(entry)
    for name, data in replace.items():
        (dst / name).write_bytes(data)
    return dst


def flipped(data: bytes, at: int = 100) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


def test_intact_directory_passes_with_the_manifest_as_fingerprint(tiny_model_dir: Path) -> None:
    assert check_model_dir(tiny_model_dir) == manifest_digest(tiny_model_dir)


def test_missing_directory_names_the_download_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "models" / "cv2"
    with pytest.raises(ModelDirError) as error:
        check_model_dir(missing)
    assert (
        str(error.value)
        == f"model directory {missing} does not exist; fetch it with `cosyserve download --dir {missing}`"
    )
    monkeypatch.setenv(MODEL_DIR_ENV, str(missing))  # the default directory needs no --dir
    with pytest.raises(ModelDirError, match=r"fetch it with `cosyserve download`$"):
        check_model_dir(missing)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ("tampered", f"{HIFT_FILE}: content differs from the manifest"),
        ("truncated", f"{HIFT_FILE}: content differs from the manifest"),
        ("extra", "evil.pt: not in the manifest"),
    ],
)
def test_damaged_directory_is_refused_naming_the_file(
    tiny_model_dir: Path, tmp_path: Path, change: str, problem: str
) -> None:
    hift = (tiny_model_dir / HIFT_FILE).read_bytes()
    replace = {
        "tampered": {HIFT_FILE: flipped(hift)},
        "truncated": {HIFT_FILE: hift[: len(hift) // 2]},
        "extra": {"evil.pt": b"unlisted"},
    }[change]
    damaged = view(tiny_model_dir, tmp_path / "damaged", replace)
    with pytest.raises(ModelDirError) as error:
        check_model_dir(damaged)
    message = str(error.value)
    assert "\n" not in message and problem in message
    assert message.endswith(f"fetch it again with `cosyserve download --dir {damaged}`")


def test_without_hash_verification_only_presence_is_checked(tiny_model_dir: Path, tmp_path: Path) -> None:
    hift = (tiny_model_dir / HIFT_FILE).read_bytes()
    damaged = view(tiny_model_dir, tmp_path / "damaged", {HIFT_FILE: flipped(hift)})
    check_model_dir(damaged, verify_hashes=False)
    (damaged / LLM_FILE).unlink()
    with pytest.raises(ModelDirError, match=r"missing llm\.pt.*`cosyserve download --dir "):
        check_model_dir(damaged, verify_hashes=False)


def test_no_manifest_is_a_warning(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bare = view(tiny_model_dir, tmp_path / "bare")
    (bare / MANIFEST_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        first = check_model_dir(bare)
    assert f"cosyserve verify --write {bare}" in caplog.text
    assert first == check_model_dir(bare) != manifest_digest(tiny_model_dir)


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        (HIFT_FILE, flipped),
        # The files are hashed while the model loads: a byte of a weight changed loads, and
        # a truncated checkpoint fails to load before its hash is checked.
        (HIFT_FILE, lambda data: flipped(data, len(data) // 2)),
        (LLM_FILE, lambda data: data[: len(data) // 2]),
    ],
    ids=["tampered", "a weight changed", "truncated"],
)
def test_app_start_refuses_a_damaged_directory(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    name: str,
    damage: Callable[[bytes], bytes],
) -> None:
    monkeypatch.setenv("COSYSERVE_AUTH_MODE", "none")  # an open server, where access control exists
    data = (tiny_model_dir / name).read_bytes()
    damaged = view(tiny_model_dir, tmp_path / "damaged", {name: damage(data)})
    fatal: list[bool] = []
    settings = Settings.load(model_dir=damaged, voices_db=tmp_path / "voices.sqlite3", grpc_port=0)
    app = create_app(settings, on_fatal=lambda: fatal.append(True))
    with caplog.at_level(logging.ERROR), TestClient(app) as client:
        deadline = time.monotonic() + 30
        while not fatal:
            assert time.monotonic() < deadline, "the start did not fail"
            time.sleep(0.05)
        assert app.state.runtime.phase is Phase.FAILED
        assert client.get("/ready").status_code == 503
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("server start failed: model directory")
    assert f"{name}: content differs" in errors[0]
