"""Shared regions on their own: sealing, mapping checks, and pinning with a CPU fallback."""

from __future__ import annotations

import fcntl
import mmap
import os
import resource

import numpy as np
import pytest

from prefixd.errors import ProtocolError
from prefixd.wire import region as region_module
from prefixd.wire.region import MappedRegion, SharedRegion


def test_a_shared_region_is_sealed_and_touched() -> None:
    with SharedRegion(1 << 20) as region:
        seals = fcntl.fcntl(region.fd, fcntl.F_GET_SEALS)
        assert (
            seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        )
        with pytest.raises(PermissionError):
            os.ftruncate(region.fd, 4096)
        assert not np.frombuffer(region.view, dtype=np.uint8).any()


def test_both_sides_see_the_same_bytes() -> None:
    with SharedRegion(8192) as region:
        mapped = MappedRegion(os.dup(region.fd), 8192, 1 << 20)
        mapped.span(4096, 5)[:] = b"hello"
        assert bytes(region.view[4096:4101]) == b"hello"
        with pytest.raises(ProtocolError, match="outside the region"):
            mapped.span(8190, 5)
        mapped.close()


@pytest.mark.parametrize(
    "size,limit,message", [(4096, 1 << 20, "differs"), (8192, 4096, "must be in")]
)
def test_mapping_refuses_wrong_sizes(size: int, limit: int, message: str) -> None:
    with SharedRegion(8192) as region:
        fd = os.dup(region.fd)
        with pytest.raises(ProtocolError, match=message):
            MappedRegion(fd, size, limit)
        with pytest.raises(OSError):
            os.fstat(fd)  # the daemon's copy of the descriptor is closed either way


def test_pin_falls_back_without_cuda() -> None:
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    with SharedRegion(1 << 20) as region:
        assert region.pin() is cuda


@pytest.mark.cuda
def test_a_pinned_region_copies_to_the_gpu() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with SharedRegion(1 << 20) as region:
        assert region.pin()
        data = np.frombuffer(region.view, dtype=np.uint8)
        data[:] = np.arange(data.size, dtype=np.uint64).astype(np.uint8)
        host = torch.frombuffer(region.view, dtype=torch.uint8)
        device = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(device.cpu(), host)
        del host, device


# --- populating the daemon's mapping at attach ------------------------------------------------


def _faults_writing_each_page(view: memoryview) -> int:
    """Minor page faults this thread takes writing one byte of each page of `view`."""
    pages = np.frombuffer(view, dtype=np.uint8)[:: mmap.PAGESIZE]
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    pages[:] = 1
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@pytest.mark.parametrize("madvise", ["populate-write", "touch-fallback"])
def test_a_populated_region_takes_no_page_faults_on_its_first_load(
    madvise: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first load into a fresh region used to fault in every page of it in the daemon."""
    if madvise == "touch-fallback":  # a kernel without MADV_POPULATE_WRITE refuses it: EINVAL
        monkeypatch.setattr(region_module, "MADV_POPULATE_WRITE", 0x7FFF)
    size = 32 << 20
    n_pages = size // mmap.PAGESIZE
    with SharedRegion(size) as region:
        mapped = MappedRegion(os.dup(region.fd), size, 1 << 30)
        assert mapped.allocated == ((0, size),)
        assert mapped.populate() == size
        assert _faults_writing_each_page(mapped.view) < n_pages // 100
        mapped.close()
        unpopulated = MappedRegion(os.dup(region.fd), size, 1 << 30)
        assert _faults_writing_each_page(unpopulated.view) > n_pages // 2  # what it saves
        unpopulated.close()


def test_populating_a_sparse_memfd_allocates_nothing() -> None:
    """A client may send a huge memfd it never touched: populating it whole would allocate all
    of it, charged to the daemon. Only the ranges the client allocated are mapped in."""
    size = 64 << 20
    fd = os.memfd_create("sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        os.pwrite(fd, b"x" * (1 << 20), 0)
        os.pwrite(fd, b"y", 32 << 20)
        allocated = os.fstat(fd).st_blocks
        mapped = MappedRegion(os.dup(fd), size, 1 << 30)
        assert mapped.allocated == ((0, 1 << 20), (32 << 20, (32 << 20) + mmap.PAGESIZE))
        assert mapped.populate() == (1 << 20) + mmap.PAGESIZE
        assert os.fstat(fd).st_blocks == allocated
        assert bytes(mapped.span(32 << 20, 1)) == b"y"
        mapped.close()
    finally:
        os.close(fd)


def test_a_memfd_in_too_many_pieces_is_not_populated(monkeypatch: pytest.MonkeyPatch) -> None:
    """One madvise per allocated piece: a region in millions of them is left to fault in."""
    monkeypatch.setattr(region_module, "MAX_POPULATED_RANGES", 3)
    size = 1 << 20
    fd = os.memfd_create("pieces", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        for page in range(0, 16, 2):
            os.pwrite(fd, b"z", page * mmap.PAGESIZE)
        mapped = MappedRegion(os.dup(fd), size, 1 << 30)
        assert mapped.allocated == ()
        assert mapped.populate() == 0
        mapped.close()
    finally:
        os.close(fd)
