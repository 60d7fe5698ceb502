"""The ``manifest.sha256`` of a model directory: writing, reading and checking it.

The format is ``sha256sum``'s (``<hex digest>  <relative/posix/path>``, one file a line,
sorted), so ``sha256sum -c manifest.sha256`` checks a directory without cosyserve. It
lists every file except itself and top-level hidden entries: download tools keep their
state there (huggingface_hub's ``.cache/``, modelscope's ``.msc``), and nothing loads them.

Hashing streams each file in fixed-size blocks (memory stays bounded whatever the file
size) and spreads files over a few threads: hashlib releases the GIL on large buffers,
so the largest file (``llm.pt``, 2 GB of the 3.3 GB directory) bounds the wall time.
"""

import hashlib
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path, PurePosixPath

from cosyserve.errors import ModelDirError
from cosyserve.modeldir.layout import MANIFEST_FILE

logger = logging.getLogger(__name__)

_BLOCK = 4 << 20
_MAX_THREADS = 4
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


class ProblemKind(StrEnum):
    MISSING = "missing"
    CHANGED = "changed"
    EXTRA = "extra"


_DESCRIPTIONS = {
    ProblemKind.MISSING: "missing",
    ProblemKind.CHANGED: "content differs from the manifest (truncated, corrupt or modified)",
    ProblemKind.EXTRA: "not in the manifest",
}


@dataclass(frozen=True)
class Problem:
    """One file that does not match the manifest; ``path`` is relative to the directory."""

    path: str
    kind: ProblemKind

    def __str__(self) -> str:
        return f"{self.path}: {_DESCRIPTIONS[self.kind]}"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in fixed-size blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def listed_files(root: Path) -> list[str]:
    """The files a manifest of ``root`` covers: relative posix paths, sorted."""
    names = []
    # os.walk rather than rglob: a directory assembled from symlinks (to shared weights)
    # must list the files behind a linked sub-directory too.
    for folder, dirs, files in os.walk(root, followlinks=True):
        base = Path(folder).relative_to(root)
        if base == Path("."):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files = [f for f in files if not f.startswith(".") and f != MANIFEST_FILE]
        names += [(base / f).as_posix() for f in files if (Path(folder) / f).is_file()]
    return sorted(names)


def hash_files(root: Path, names: Iterable[str]) -> dict[str, str]:
    """sha256 of each named file under ``root``, largest first over a few threads."""
    ordered = sorted(names, key=lambda name: (root / name).stat().st_size, reverse=True)
    threads = max(1, min(_MAX_THREADS, os.cpu_count() or 1, len(ordered)))
    with ThreadPoolExecutor(threads, thread_name_prefix="cosyserve-sha256") as pool:
        digests = pool.map(lambda name: sha256_file(root / name), ordered)
        return dict(zip(ordered, digests, strict=True))


def write_manifest(root: Path, known: Mapping[str, str] | None = None) -> Path:
    """Write ``root/manifest.sha256`` for every file :func:`listed_files` finds.

    ``known``: digests already computed (e.g. while checking a download), reused instead
    of hashing those files again. The file is replaced atomically.
    """
    names = listed_files(root)
    known = known or {}
    digests = {name: known[name] for name in names if name in known}
    digests |= hash_files(root, [name for name in names if name not in digests])
    text = "".join(f"{digests[name]}  {name}\n" for name in names)
    target = root / MANIFEST_FILE
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST_FILE}.", suffix=".tmp", dir=root)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    logger.info("wrote %s: %d files", target, len(names))
    return target


def read_manifest(root: Path) -> dict[str, str]:
    """The manifest of ``root``: relative path -> hex sha256. :class:`ModelDirError` if it
    is missing or malformed (naming the line)."""
    path = root / MANIFEST_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelDirError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelDirError(f"{path}: not readable ({exc.__class__.__name__})") from None
    entries: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        match = _LINE.match(line)
        if match is None or not _safe(match.group(2)) or match.group(2) in entries:
            raise ModelDirError(f"{path}, line {number}: not a '<sha256>  <relative path>' line")
        entries[match.group(2)] = match.group(1)
    return entries


def check_manifest(root: Path, *, hashes: bool = True) -> list[Problem]:
    """Every difference between ``root`` and its manifest, sorted by path: listed files
    that are missing or (with ``hashes``) whose content differs, and files not listed."""
    expected = read_manifest(root)
    present = set(listed_files(root))
    problems = [Problem(name, ProblemKind.MISSING) for name in expected if name not in present]
    problems += [Problem(name, ProblemKind.EXTRA) for name in present if name not in expected]
    if hashes:
        actual = hash_files(root, [name for name in expected if name in present])
        problems += [Problem(n, ProblemKind.CHANGED) for n, d in actual.items() if d != expected[n]]
    return sorted(problems, key=lambda p: p.path)


def manifest_digest(root: Path) -> str | None:
    """sha256 of the manifest file itself (a fingerprint of the whole directory), or None
    without one."""
    path = root / MANIFEST_FILE
    return sha256_file(path) if path.is_file() else None


def _safe(name: str) -> bool:
    """A relative path that stays inside the directory (no absolute path, no ``..``)."""
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts and "\\" not in name and name == path.as_posix()
