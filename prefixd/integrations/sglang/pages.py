"""Pages between SGLang's host pools and prefixd's shared region, one copy each way.

A stored page is exactly SGLang's flat page, so v0 (flat tensors), v1 and v2 (host indices) read
each other's pages: the pool's strided page view is gathered straight into the region in flat
order, and a loaded page is written back with the pool's own `set_from_flat_data_page`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch


def region_tensor(view: memoryview) -> torch.Tensor:
    """Region bytes as a uint8 tensor without a copy (a loaded view is read-only: torch warns
    about that, and nothing writes through it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


class Pool:
    """One host pool and the size and dtype of its flat page (read once)."""

    def __init__(self, host_pool: Any) -> None:
        dummy = host_pool.get_dummy_flat_data_page()
        self.host_pool = host_pool
        self.page_bytes = int(dummy.nbytes)
        self.dtype: torch.dtype = dummy.dtype
        self.page_size = int(getattr(host_pool, "page_size", 1) or 1)


def copy_out(pool: Pool, index: int, destination: memoryview) -> None:
    """The page at host slot `index` into `destination`, as its flat page's bytes."""
    page = pool.host_pool.get_data_page(index, flat=False)
    region_tensor(destination).view(page.dtype).view(page.shape).copy_(page)


def copy_in(pool: Pool, index: int, source: memoryview) -> bool:
    """A stored page into host slot `index`; False (nothing written) when its size is not this
    pool's page size."""
    if len(source) != pool.page_bytes:
        return False
    pool.host_pool.set_from_flat_data_page(index, region_tensor(source).view(pool.dtype))
    return True


def tensor_bytes(value: torch.Tensor) -> torch.Tensor:
    """A flat page tensor as contiguous bytes (a view when it is contiguous already)."""
    return value.contiguous().view(-1).view(torch.uint8)


__all__ = ["Pool", "copy_in", "copy_out", "region_tensor", "tensor_bytes"]
