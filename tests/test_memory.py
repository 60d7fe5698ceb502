"""Freed tensor memory stays in the process for the next tensors (glibc).

Each measurement runs in a new interpreter: what a process freed before (and kept, once
any engine of the test session has started) would hide the page faults being counted."""

import ctypes
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cosyserve.memory import PageReleaser, lazy_zeros, prefetch, release_pages, retain_freed_memory
from cosyserve.models.kv_cache import KVCache

_ROUNDS = """
import json, resource, sys, threading
import torch
from cosyserve.memory import retain_freed_memory

if sys.argv[1] == "retain":
    assert retain_freed_memory()
faults = []

def rounds():  # on a thread of its own: its own malloc arena, as the engine's thread
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        tensors = [torch.empty(3 << 19, dtype=torch.uint8).fill_(1) for _ in range(1365)]
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
        del tensors

thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(json.dumps(faults))
"""


def _faults_of_two_rounds(mode: str) -> tuple[int, int]:
    """Page faults of writing 1365 tensors of 1.5 MiB (2 GiB), twice (all freed in between)."""
    out = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True, timeout=120
    )
    first, second = json.loads(out.stdout)
    return first, second


@pytest.mark.slow  # writes 2 GiB four times in fresh interpreters
def test_freed_memory_is_reused_without_page_faults() -> None:
    if not retain_freed_memory():
        pytest.skip("the C library is not glibc")
    # The first round faults its new pages in (2 GiB: 524,288 pages, faulted a few at a
    # time); glibc's defaults fault as many again in the second. Retained memory faults
    # under 2 % of them (measured: 2,300 of 262,000, 0.9 %; with 1 MiB tensors 1,500, 0.6 %);
    # the trim and mmap thresholds alone kept too little (1 MiB tensors: 28,900, 11 %), as
    # the thread's arena unmapped its free heaps.
    first, second = _faults_of_two_rounds("defaults")
    assert first > 2048 * 64 and second > first // 2
    first, second = _faults_of_two_rounds("retain")
    assert first > 2048 * 64 and second < first // 50


def _resident_share(tensor: torch.Tensor) -> float:
    """Share of the pages under ``tensor`` in the page cache (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    storage = tensor.untyped_storage()
    start = storage.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    pages = -(-(storage.data_ptr() + storage.nbytes() - start) // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, pages * mmap.PAGESIZE, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector) / pages


def test_lazy_zeros_become_resident_only_where_written() -> None:
    tensor = lazy_zeros((64, 1024, 256), torch.float32)  # 64 MiB
    assert tensor.shape == (64, 1024, 256) and tensor.dtype == torch.float32
    assert _resident_share(tensor) == 0
    tensor[3] = 1.0  # 1 MiB
    # Whole pages only (2 MiB where the kernel backs the mapping with huge pages).
    assert 0 < _resident_share(tensor) <= 1 / 16
    view = tensor[3:5]
    del tensor  # the view keeps the mapping
    assert bool((view[0] == 1).all()) and int(view[1].count_nonzero()) == 0


def test_a_cpu_kv_cache_holds_no_memory_before_it_is_written() -> None:
    cache = KVCache(num_layers=4, num_kv_heads=2, head_dim=64, max_slots=8, max_len=2048)  # 2 x 16 MiB
    assert _resident_share(cache.k) == 0 and _resident_share(cache.v) == 0
    slot = cache.allocate()
    k = torch.ones(4, 10, 2, 64)
    cache.load_prefix(slot, k, 2 * k)
    assert 0 < _resident_share(cache.k) <= 1 / 16
    keys, values = cache.read(slot, 0, 10)
    assert bool((keys == 1).all()) and bool((values == 2).all())
    cache.free(slot)
    assert int(cache.k.count_nonzero()) == int(cache.v.count_nonzero()) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_prefetch_reads_a_memory_mapped_tensor_into_the_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    torch.save({"embedding": torch.randn(4096, 512)}, path)  # 8 MiB
    with path.open("rb") as file:  # out of the page cache, once written to disk
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    embedding = torch.load(path, mmap=True, weights_only=True)["embedding"]
    if _resident_share(embedding) > 0.5:
        pytest.skip("this file system keeps files in memory (tmpfs): nothing to read")
    assert prefetch(embedding) == embedding.untyped_storage().nbytes()
    assert _resident_share(embedding) == 1.0
    assert prefetch(torch.randn(4096, 512)) == 0  # anonymous memory: nothing to read


def _mapped_resident_kib(tensor: torch.Tensor) -> int:
    """Resident KiB of the file mapping holding ``tensor``, from ``/proc/self/smaps``."""
    address = tensor.untyped_storage().data_ptr()
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(bound, 16) for bound in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("the tensor is not in a mapping")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_release_pages_drops_a_mapped_tensors_pages_and_keeps_its_values(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    original = torch.randn(4096, 512)  # 8 MiB
    torch.save({"weight": original, "other": torch.randn(1000)}, path)
    weight = torch.load(path, mmap=True, weights_only=True)["weight"]
    float(weight.sum())  # read: now resident in the process
    assert _mapped_resident_kib(weight) >= 8192
    released = release_pages([weight])
    storage = weight.untyped_storage()
    assert storage.nbytes() - 2 * mmap.PAGESIZE < released <= storage.nbytes()
    assert _mapped_resident_kib(weight) < 64  # at most the pages it shares
    assert torch.equal(weight, original)  # read back from the file, as it was
    anonymous = original.clone()
    assert release_pages([anonymous]) == 0
    assert torch.equal(anonymous, original)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_page_releaser_finds_files_mapped_after_its_first_call(tmp_path: Path) -> None:
    release = PageReleaser()
    tensors = []
    for name in ("a.pt", "b.pt"):  # b.pt is mapped only after the first call
        torch.save({"weight": torch.randn(1024, 512)}, tmp_path / name)  # 2 MiB
        tensor = torch.load(tmp_path / name, mmap=True, weights_only=True)["weight"]
        float(tensor.sum())
        assert release([tensor]) > (2 << 20) - 2 * mmap.PAGESIZE
        tensors.append(tensor)
    assert all(_mapped_resident_kib(tensor) < 64 for tensor in tensors)
