"""manifest.sha256: round trip, and every kind of damage named by file."""

import hashlib
import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cosyserve.cli.main import app
from cosyserve.errors import ModelDirError
from cosyserve.modeldir.layout import MANIFEST_FILE
from cosyserve.modeldir.manifest import (
    Problem,
    ProblemKind,
    check_manifest,
    listed_files,
    read_manifest,
    sha256_file,
    write_manifest,
)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A small random directory with a sub-directory and a hidden tool folder."""
    root = tmp_path / "model"
    for name, size in {"a.bin": 5000, "sub/b.bin": 3 * (4 << 20) + 17, "sub/deeper/c.txt": 10}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(os.urandom(size))
    (root / ".cache" / "huggingface").mkdir(parents=True)
    (root / ".cache" / "huggingface" / "state.lock").write_bytes(b"x")
    write_manifest(root)
    return root


def test_round_trip_lists_every_file_with_its_sha256(tree: Path) -> None:
    entries = read_manifest(tree)
    assert list(entries) == ["a.bin", "sub/b.bin", "sub/deeper/c.txt"]  # sorted, hidden tool state left out
    for name, digest in entries.items():
        assert digest == hashlib.sha256((tree / name).read_bytes()).hexdigest()
    assert check_manifest(tree) == []


def test_format_is_sha256sum_compatible(tree: Path) -> None:
    result = subprocess.run(
        ["sha256sum", "--check", "--strict", MANIFEST_FILE], cwd=tree, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": OK") == 3


def test_a_flipped_byte_is_named(tree: Path) -> None:
    path = tree / "sub" / "b.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    problems = check_manifest(tree)
    assert problems == [Problem("sub/b.bin", ProblemKind.CHANGED)]
    assert str(problems[0]) == "sub/b.bin: content differs from the manifest (truncated, corrupt or modified)"


def test_truncated_missing_and_extra_files_are_named(tree: Path) -> None:
    with (tree / "sub" / "b.bin").open("r+b") as f:
        f.truncate(100)
    (tree / "a.bin").unlink()
    (tree / "sub" / "new.bin").write_bytes(b"new")
    assert check_manifest(tree) == [
        Problem("a.bin", ProblemKind.MISSING),
        Problem("sub/b.bin", ProblemKind.CHANGED),
        Problem("sub/new.bin", ProblemKind.EXTRA),
    ]


def test_without_hashes_only_presence_is_checked(tree: Path) -> None:
    (tree / "a.bin").write_bytes(b"changed")
    (tree / "extra").write_bytes(b"")
    assert check_manifest(tree, hashes=False) == [Problem("extra", ProblemKind.EXTRA)]


def test_known_digests_are_reused(tree: Path) -> None:
    write_manifest(tree, known={"a.bin": "0" * 64})
    assert read_manifest(tree)["a.bin"] == "0" * 64
    assert read_manifest(tree)["sub/b.bin"] == sha256_file(tree / "sub" / "b.bin")


def test_symlinked_directories_are_followed(tree: Path, tmp_path: Path) -> None:
    view = tmp_path / "view"
    view.mkdir()
    for entry in tree.iterdir():
        (view / entry.name).symlink_to(entry)
    assert listed_files(view) == ["a.bin", "sub/b.bin", "sub/deeper/c.txt"]
    assert check_manifest(view) == []


@pytest.mark.parametrize(
    "line",
    [
        "not a digest  a.bin",
        f"{'a' * 64}  /etc/passwd",
        f"{'a' * 64}  ../outside",
        f"{'A' * 64}  a.bin",
        f"{'a' * 64}a.bin",
    ],
)
def test_malformed_or_escaping_lines_are_refused(tree: Path, line: str) -> None:
    (tree / MANIFEST_FILE).write_text(f"{'b' * 64}  c.bin\n{line}\n")
    with pytest.raises(ModelDirError, match=rf"{MANIFEST_FILE}, line 2: not a"):
        read_manifest(tree)


def test_missing_manifest_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match=r"manifest\.sha256 does not exist"):
        check_manifest(tmp_path)


def test_verify_command(tiny_model_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(tiny_model_dir)])
    assert ok.exit_code == 0 and ok.stdout.startswith("OK    sha256 of ")
    copy = tmp_path / "copy"
    copy.mkdir()
    for entry in tiny_model_dir.iterdir():
        (copy / entry.name).symlink_to(entry)
    (copy / "hift.pt").unlink()
    (copy / "hift.pt").write_bytes((tiny_model_dir / "hift.pt").read_bytes()[:-1])
    bad = runner.invoke(app, ["verify", str(copy)])
    assert bad.exit_code == 2
    assert bad.stdout == "FAIL  hift.pt: content differs from the manifest (truncated, corrupt or modified)\n"
    assert bad.stderr == f"error: 1 file(s) do not match {copy / MANIFEST_FILE}\n"
    assert runner.invoke(app, ["verify", "--no-hashes", str(copy)]).exit_code == 0
    (copy / MANIFEST_FILE).unlink()
    missing = runner.invoke(app, ["verify", str(copy)])
    assert missing.exit_code == 2 and f"`cosyserve verify --write {copy}`" in missing.stderr
    written = runner.invoke(app, ["verify", "--write", str(copy)])
    assert written.exit_code == 0 and runner.invoke(app, ["verify", str(copy)]).exit_code == 0
