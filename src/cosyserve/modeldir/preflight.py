"""The model directory check ``serve`` runs before loading: there, complete, untampered.

Each failure is one :class:`ModelDirError` line that names the directory, the files at
fault, and the command that fixes it (``cosyserve download``). :func:`check_model_dir`
also returns the directory's fingerprint, which keys anything derived from the weights
(the audio cache).
"""

import hashlib
import logging
import shlex
from pathlib import Path

from cosyserve.errors import ModelDirError
from cosyserve.modeldir.layout import MANIFEST_FILE, ModelDir
from cosyserve.modeldir.manifest import check_manifest, listed_files, manifest_digest
from cosyserve.paths import default_model_dir

logger = logging.getLogger(__name__)

# Problems named in one error line; the rest are counted (``cosyserve verify`` lists all).
_NAMED = 5


def download_command(path: Path) -> str:
    """The command that fetches the official weights into ``path``."""
    if path.expanduser().absolute() == default_model_dir().absolute():
        return "cosyserve download"
    return f"cosyserve download --dir {shlex.quote(str(path))}"


def check_model_dir(path: Path, *, verify_hashes: bool = True) -> str:
    """Check ``path`` and return its fingerprint.

    Checks that it exists (else says which command fetches it), has the CosyVoice2
    layout, and matches its ``manifest.sha256``: no listed file missing, no unlisted
    file, and with ``verify_hashes`` every file's sha256. A directory without a manifest
    is accepted with a warning (one fetched by other means has none).
    """
    if not path.exists():
        raise ModelDirError(
            f"model directory {path} does not exist; fetch it with `{download_command(path)}`"
        )
    try:
        ModelDir.open(path)
    except ModelDirError as exc:
        raise ModelDirError(f"{exc}; fetch the official files with `{download_command(path)}`") from None
    fingerprint = manifest_digest(path)
    if fingerprint is None:
        logger.warning(
            "%s has no %s: its files cannot be checked; write one with `cosyserve verify --write %s`",
            path,
            MANIFEST_FILE,
            shlex.quote(str(path)),
        )
        return _stat_fingerprint(path)
    problems = check_manifest(path, hashes=verify_hashes)
    if problems:
        named = "; ".join(str(p) for p in problems[:_NAMED])
        more = f" (and {len(problems) - _NAMED} more)" if len(problems) > _NAMED else ""
        raise ModelDirError(
            f"model directory {path} does not match its {MANIFEST_FILE}: {named}{more}; "
            f"fetch it again with `{download_command(path)}`"
        )
    return fingerprint


def _stat_fingerprint(path: Path) -> str:
    """Without a manifest: names, sizes and modification times (changes with any rewrite)."""
    digest = hashlib.sha256()
    for name in listed_files(path):
        stat = (path / name).stat()
        digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()
