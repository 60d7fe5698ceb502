"""Keep the memory that tensors free inside the process, for the next tensors to reuse.

torch's CPU tensors come from the C library's ``malloc``. glibc hands memory back to the
kernel eagerly: chunks above a (self-adjusting) size threshold are separate mappings,
unmapped when freed, and the arenas of threads other than the main one (the engine runs
on its own thread) trim their free space back to the kernel and unmap their heaps that
become wholly free. The next tensor of that size then faults its pages in again, and on a
virtual machine that hands freed memory back to its host a page fault can cost up to 40 µs
(a few µs where the guest reuses a page it has just freed). A stream's chunks fault in
tens of thousands of pages each on new memory, and a small fraction of that when the
stream before it left its memory in the process (``docs/performance.md``, "Physical
limits").

:func:`retain_freed_memory` sets glibc's thresholds so that chunks up to 32 MiB come from
the arenas and freed arena memory stays in the process (the top pad matters too: with the
trim and mmap thresholds alone, a thread that allocated again the 1 MiB tensors it had
freed still faulted about a tenth of their pages in). The process's resident memory then
stays at its high-water mark (as with a preallocated cache pool) instead of shrinking
between bursts of requests; its peak stays about where it was.

:func:`release_pages` drops from the process the pages of memory-mapped checkpoint tensors
that loading read once to convert or quantize them, so that they neither count in its
resident memory nor raise its peak.

:func:`prefetch` is for memory-mapped weights that are read a few rows at a time (the text
embedding): it reads their file into the page cache at load, so that a request's first
use of a row is not a disk read.
"""

import ctypes
import logging
import math
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts on 64-bit systems (HEAP_MAX_SIZE / 2).
_MMAP_THRESHOLD = 32 << 20
# glibc reads the trim threshold as unsigned: -1 never trims (a free top above the
# threshold is given back whole, so any finite value still returns a burst's memory).
_NEVER_TRIM = -1
# A thread's arena is a chain of heaps of at most 64 MiB (HEAP_MAX_SIZE), and free() unmaps
# a heap at the chain's end that has become wholly free unless the heap before it has less
# than the top pad free: a pad of a whole heap keeps every heap. (The pad is also the
# address space added when an arena grows: reserved, never touched, no memory.)
_TOP_PAD = 64 << 20
# madvise advice (Linux mman.h): the pages may be dropped; a file mapping refaults them.
_MADV_DONTNEED = 4
# Read by prefetch at a time, into one reused buffer.
_PREFETCH_CHUNK = 8 << 20


def retain_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory in the process (see the module's text).
    Returns False where the C library is not glibc (nothing is changed then)."""
    # The symbols the process has loaded, the C library's among them: find_library would
    # run ldconfig in a subprocess each time an engine starts.
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return False
    applied: bool = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
    applied = libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1 and applied
    applied = libc.mallopt(_M_TOP_PAD, _TOP_PAD) == 1 and applied
    if not applied:
        logger.warning("glibc refused the malloc thresholds; freed memory goes back to the kernel")
    return applied


def prefetch(tensor: torch.Tensor) -> int:
    """Read the file under ``tensor`` (a CPU tensor memory-mapped from a checkpoint) into
    the page cache now; returns the bytes read (0 for a tensor not mapped from a file).

    The pages go to the page cache, not into the process: its resident memory grows only
    as rows are used, as before, but a first use is then a minor fault (microseconds)
    instead of a read from disk (milliseconds). The text embedding is 544 MiB of float32
    memory-mapped from ``llm.pt``, of which a request reads a few dozen rows: each new
    text cost a few disk reads per lookup, milliseconds each, in its first audio.
    ``madvise`` and ``posix_fadvise`` with ``WILLNEED`` can read nothing (on the virtual
    machines tried, the residency ``mincore`` reports did not move), so the file is read
    with ``pread``: about 1 s for the embedding from a cold disk, 0.1 s from the page
    cache."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return 0
    storage = tensor.untyped_storage()
    mapping = _mapping_at(storage.data_ptr(), _file_mappings())
    if mapping is None or not Path(mapping[2]).is_file():
        return 0
    start, _, path, file_offset = mapping
    offset = file_offset + storage.data_ptr() - start
    buffer = bytearray(_PREFETCH_CHUNK)
    done = 0
    with open(path, "rb", buffering=0) as file:
        while done < storage.nbytes():
            view = memoryview(buffer)[: min(_PREFETCH_CHUNK, storage.nbytes() - done)]
            read = os.preadv(file.fileno(), [view], offset + done)
            if read == 0:
                break
            done += read
    return done


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in memory of its own whose pages become resident only when
    written: an anonymous mapping, which the kernel fills with zeros page by page on
    first write (a page only read stays the shared zero page). For a large buffer of which
    little is ever written, such as the LM's KV cache with a slot per concurrent request
    for up to ``max_len`` positions each: ``torch.zeros`` writes every page (453 MiB for
    the full model's 9 float32 slots of 2048 positions, of which 8 streams of 6 s write
    about 60 MiB)."""
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # frombuffer keeps the mapping alive as long as the tensor (or a view of it) lives.
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


def release_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Drop the process's pages of the memory-mapped ``tensors``, which loading has read to
    convert or quantize them and will not read again; returns the bytes released. Only
    whole pages inside a tensor's storage are dropped (a page shared with a neighbour in
    the file stays), and only for tensors mapped from a regular file:
    ``madvise(MADV_DONTNEED)`` on anonymous memory would zero it.

    A memory-mapped checkpoint stays mapped as long as any of its tensors is in use (the
    float32 text embedding keeps ``llm.pt`` mapped under int8), and every page read while
    quantizing the decoder stayed resident with it: 1.4 GiB of ``llm.pt`` under
    ``--quantize int8``. The pages stay in the page cache; were a dropped tensor read
    again, its pages would fault back in from the file with the same contents (the
    checkpoint's tensors are never written to). For many calls, use one
    :class:`PageReleaser`."""
    return PageReleaser()(tensors)


class PageReleaser:
    """:func:`release_pages` over many calls: the process's mappings are read once (about
    1.5 ms), and again only for a tensor outside every mapping read so far."""

    def __init__(self) -> None:
        self._mappings: list[tuple[int, int, str, int]] | None = None
        self._regular: dict[str, bool] = {}
        self._libc: ctypes.CDLL | None = None

    def __call__(self, tensors: Iterable[torch.Tensor]) -> int:
        released = 0
        for tensor in tensors:
            if tensor.device.type != "cpu" or tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            if not self._in_regular_file(storage.data_ptr()):
                continue
            first = -(-storage.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
            last = (storage.data_ptr() + storage.nbytes()) // mmap.PAGESIZE * mmap.PAGESIZE
            if last > first and self._madvise(first, last - first) == 0:
                released += last - first
        return released

    def _in_regular_file(self, address: int) -> bool:
        """Whether ``address`` lies in a mapping of a regular file (not a device such as
        ``/dev/zero``, whose private mapping is anonymous memory, nor a deleted file)."""
        mapping = None if self._mappings is None else _mapping_at(address, self._mappings)
        if mapping is None:
            self._mappings = _file_mappings()
            mapping = _mapping_at(address, self._mappings)
        if mapping is None:
            return False
        path = mapping[2]
        if path not in self._regular:
            self._regular[path] = Path(path).is_file()
        return self._regular[path]

    def _madvise(self, start: int, length: int) -> int:
        if self._libc is None:
            self._libc = ctypes.CDLL(None, use_errno=True)
            self._libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return int(self._libc.madvise(start, length, _MADV_DONTNEED))


def _file_mappings() -> list[tuple[int, int, str, int]]:
    """The process's mappings with a path as (start, end, path, file offset of start), from
    ``/proc/self/maps`` (Linux; empty elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    mappings = []
    for line in lines:
        fields = line.split(maxsplit=5)  # start-end perms offset dev inode [path]
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            mappings.append((start, end, fields[5], int(fields[2], 16)))
    return mappings


def _mapping_at(address: int, mappings: list[tuple[int, int, str, int]]) -> tuple[int, int, str, int] | None:
    """The mapping of ``mappings`` holding ``address``, or None."""
    return next((m for m in mappings if m[0] <= address < m[1]), None)
