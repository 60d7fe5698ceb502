"""Fetch the official weights (CosyVoice2-0.5B or Fun-CosyVoice3-0.5B-2512) and write the
directory's manifest.

From the Hugging Face Hub (``huggingface_hub``; ``endpoint`` or ``HF_ENDPOINT`` selects a
mirror) or ModelScope (``modelscope``): both are the optional ``download`` extra. By
default only the files cosyserve loads are fetched (about 3.3 GB for CosyVoice 2; CosyVoice
3's RL-tuned LM, ``llm.rl.pt``, where the snapshot has it, too); ``everything`` takes
the whole snapshot (the unused Qwen weights, JIT and TensorRT exports, assets).

Resumable: a transfer cut off mid-file resumes with a Range request (up to five times);
files already complete are kept, so running the command again fetches only what is
missing. After the transfer every file is checked against the hub's own checksums (the
LFS sha256 of large files, the git blob sha1 of small ones); a file that does not match
is deleted, so that the next run fetches it again. Then ``manifest.sha256`` is written,
which ``cosyserve verify`` and ``serve`` check.
"""

import fnmatch
import hashlib
import importlib
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from cosyserve.errors import CosyserveError
from cosyserve.modeldir.family import Family
from cosyserve.modeldir.layout import LLM_RL_FILE, QWEN_DIR, SPK2INFO_FILE, ModelDir
from cosyserve.modeldir.manifest import hash_files, listed_files, write_manifest

if TYPE_CHECKING:
    from huggingface_hub.hf_api import RepoFile

logger = logging.getLogger(__name__)


class Source(StrEnum):
    HUGGINGFACE = "huggingface"
    MODELSCOPE = "modelscope"


REPOS = {
    (Family.COSYVOICE2, Source.HUGGINGFACE): "FunAudioLLM/CosyVoice2-0.5B",
    (Family.COSYVOICE2, Source.MODELSCOPE): "iic/CosyVoice2-0.5B",
    (Family.COSYVOICE3, Source.HUGGINGFACE): "FunAudioLLM/Fun-CosyVoice3-0.5B-2512",
    (Family.COSYVOICE3, Source.MODELSCOPE): "FunAudioLLM/Fun-CosyVoice3-0.5B-2512",
}


def wanted(family: Family) -> tuple[str, ...]:
    """What cosyserve reads of ``family``'s snapshot. The Qwen weights are not: llm.pt
    overwrites every one of them."""
    rl = (LLM_RL_FILE,) if family is Family.COSYVOICE3 else ()
    return (*family.required_files, *rl, SPK2INFO_FILE, f"{QWEN_DIR}/*")


SKIPPED = (f"{QWEN_DIR}/model.safetensors",)
_INSTALL = "pip install 'cosyserve[download]'"
_BLOCK = 1 << 20


class DownloadError(CosyserveError):
    """The download could not start or finish; the message says what to do."""

    code = "download_failed"


@dataclass(frozen=True)
class DownloadResult:
    """``repo``: where it came from; ``commit``: the snapshot's revision (None where the
    source does not say).
    ``local_only``: files in the directory that are not part of the snapshot (listed in
    the manifest as they are)."""

    directory: Path
    repo: str
    commit: str | None
    files: int
    total_bytes: int
    local_only: tuple[str, ...]


def download(
    target: Path,
    source: Source | str = Source.HUGGINGFACE,
    *,
    family: Family | str = Family.COSYVOICE2,
    revision: str | None = None,
    endpoint: str | None = None,
    everything: bool = False,
    hf_cache_dir: Path | None = None,
    max_workers: int = 8,
) -> DownloadResult:
    """Fetch the snapshot into ``target`` (created if needed), check it, write its manifest.

    ``hf_cache_dir``: huggingface_hub's cache, from which files already there are copied
    instead of downloaded (default: huggingface_hub's own). Raises :class:`DownloadError`.
    """
    source, family = Source(source), Family(family)
    repo = REPOS[family, source]
    target.mkdir(parents=True, exist_ok=True)
    allow, ignore = (None, None) if everything else (list(wanted(family)), list(SKIPPED))
    known: dict[str, str] = {}
    commit = None
    if source is Source.HUGGINGFACE:
        commit, known = _from_huggingface(
            repo, target, revision, endpoint, allow, ignore, hf_cache_dir, max_workers
        )
    else:
        _from_modelscope(repo, target, revision, allow, ignore)
    try:
        got = ModelDir.open(target).family
    except CosyserveError as exc:
        raise DownloadError(f"the downloaded snapshot is not usable: {exc}") from None
    if got is not family:
        raise DownloadError(f"{target} holds a {got.official_name} directory, not {family.official_name}")
    write_manifest(target, known)
    names = listed_files(target)
    return DownloadResult(
        directory=target,
        repo=repo,
        commit=commit,
        files=len(names),
        total_bytes=sum((target / name).stat().st_size for name in names),
        local_only=tuple(name for name in names if known and name not in known),
    )


def _from_huggingface(
    repo: str,
    target: Path,
    revision: str | None,
    endpoint: str | None,
    allow: list[str] | None,
    ignore: list[str] | None,
    hf_cache_dir: Path | None,
    max_workers: int,
) -> tuple[str, dict[str, str]]:
    """Download and check; returns the commit and the sha256 of every fetched file."""
    try:
        import httpx2
        import huggingface_hub
        from huggingface_hub.hf_api import RepoFile
    except ImportError:
        raise DownloadError(
            f"downloading from the Hugging Face Hub needs huggingface_hub: {_INSTALL}"
        ) from None
    try:
        api = huggingface_hub.HfApi(endpoint=endpoint)
        commit = api.model_info(repo, revision=revision).sha
        if commit is None:
            raise DownloadError(f"the hub did not name the commit of {repo} at {revision or 'main'}")
        tree = [
            f for f in api.list_repo_tree(repo, recursive=True, revision=commit) if isinstance(f, RepoFile)
        ]
        files = {f.path: f for f in tree if _selected(f.path, allow, ignore)}
        _check_space(target, files)
        logger.info("downloading %d files of %s@%s into %s", len(files), repo, commit[:12], target)
        huggingface_hub.snapshot_download(
            repo,
            revision=commit,
            local_dir=target,
            allow_patterns=allow,
            ignore_patterns=ignore,
            endpoint=endpoint,
            cache_dir=hf_cache_dir,
            max_workers=max_workers,
        )
    except (OSError, ValueError, httpx2.HTTPError) as exc:
        raise DownloadError(
            f"download from {repo} failed ({exc.__class__.__name__}: {_first_line(exc)}); "
            "run the same command again to resume: finished files are kept"
        ) from None
    return commit, _check_against_hub(target, files)


def _from_modelscope(
    repo: str, target: Path, revision: str | None, allow: list[str] | None, ignore: list[str] | None
) -> None:
    try:
        modelscope = importlib.import_module("modelscope")
    except ImportError:
        raise DownloadError(f"downloading from ModelScope needs modelscope: {_INSTALL}") from None
    try:
        # modelscope checks each file's sha256 against its hub while downloading.
        modelscope.snapshot_download(
            repo, revision=revision, local_dir=str(target), allow_patterns=allow, ignore_patterns=ignore
        )
    except (OSError, ValueError) as exc:
        raise DownloadError(
            f"download from ModelScope {repo} failed ({exc.__class__.__name__}: {_first_line(exc)}); "
            "run the same command again to resume"
        ) from None


def _selected(path: str, allow: list[str] | None, ignore: list[str] | None) -> bool:
    """huggingface_hub's pattern rule (fnmatch), to know the files before it fetches them."""
    if allow is not None and not any(fnmatch.fnmatch(path, p) for p in allow):
        return False
    return ignore is None or not any(fnmatch.fnmatch(path, p) for p in ignore)


def _check_space(target: Path, files: Mapping[str, "RepoFile"]) -> None:
    missing = sum(f.size for name, f in files.items() if not (target / name).is_file())
    free = shutil.disk_usage(target).free
    if missing > free:
        raise DownloadError(f"{target} has {free >> 20} MiB free; the download needs {missing >> 20} MiB")


def _check_against_hub(target: Path, files: Mapping[str, "RepoFile"]) -> dict[str, str]:
    """sha256 of every file, after checking each against the hub's checksum; a file that
    does not match is deleted and named in the :class:`DownloadError`."""
    absent = sorted(name for name in files if not (target / name).is_file())
    if absent:
        raise DownloadError(f"files missing after the download: {', '.join(absent)}; run the command again")
    sha256 = hash_files(target, files)
    bad = []
    for name, entry in files.items():
        path = target / name
        if entry.lfs is not None:
            ok = path.stat().st_size == entry.lfs.size and sha256[name] == entry.lfs.sha256
        else:
            ok = path.stat().st_size == entry.size and _git_blob_sha1(path) == entry.blob_id
        if not ok:
            bad.append(name)
            path.unlink()
    if bad:
        raise DownloadError(
            f"{', '.join(sorted(bad))}: checksum differs from the hub's (deleted); run the command again"
        )
    return sha256


def _git_blob_sha1(path: Path) -> str:
    """git's object id of a file: sha1 of ``blob <size>\\0`` and the content."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else "no details"
