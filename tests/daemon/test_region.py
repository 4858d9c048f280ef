"""Shared regions on their own: sealing, mapping checks, and pinning with a CPU fallback."""

from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest

from prefixd.errors import ProtocolError
from prefixd.wire.region import MappedRegion, SharedRegion


def test_a_shared_region_is_sealed_and_touched() -> None:
    with SharedRegion(1 << 20) as region:
        seals = fcntl.fcntl(region.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
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
