"""The direct spec's copies between the KV cache and shared regions, apart from vLLM (its worker,
worker.py, says which blocks and chunks; this module moves their bytes), so the same path runs in
a test on any device with torch alone.

A chunk's payload is its group's layers in order, each layer's `per` pages of that layer's bytes.
A load copies payloads held verified in the scheduler's region (mapped here through /proc, its
inode checked) into the KV cache's blocks; a store gathers blocks into a lease of the worker's own
region. On CUDA the regions are registered with the device, each run of payloads lying back to
back crosses in one copy on a stream of its own (queued after what the engine's stream queued),
and the pages are scattered or gathered on the device; without CUDA each block is one memcpy.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prefixd.integrations.vllm.staging import RegionRef
from prefixd.wire.region import pin_with_cuda, unpin_with_cuda

HeldPayload = tuple[RegionRef, int, int]
"""A payload held in a region: the region, the payload's offset in it and its length."""


@dataclass(frozen=True)
class Layout:
    """A group's payload: for each layer (ref), `per` pages of `sizes[i]` bytes at `starts[i]`."""

    tensors: tuple[int, ...]  # the KV tensor of each layer
    sizes: tuple[int, ...]
    starts: tuple[int, ...]
    per: int
    nbytes: int

    @classmethod
    def of(cls, refs: Sequence[Any], per: int) -> Layout:
        sizes = tuple(int(ref.page_size_bytes) for ref in refs)
        starts = tuple(int(s) for s in np.cumsum((0, *sizes[:-1])) * per)
        return cls(tuple(ref.tensor_idx for ref in refs), sizes, starts, per, sum(sizes) * per)

    def layers(self, payloads: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Each layer's tensor index, page bytes and pages (k, per, bytes) in `payloads` (k, P)."""
        k = payloads.shape[0]
        for tensor, size, start in zip(self.tensors, self.sizes, self.starts, strict=True):
            pages = payloads[:, start : start + self.per * size].view(k, self.per, size)
            yield tensor, size, pages


@dataclass(frozen=True)
class Places:
    """Where each block of a copy goes: KV cache block `blocks[i]` is page `pages[i]` of payload
    `chunks[i]`. On a device one indexed copy moves them all (its kernels gather in parallel); on
    the CPU each block is one memcpy on this thread (torch's CPU indexing kernels move a byte at a
    time, about 0.8 GB/s, and its copies split across the engine's busy threads: half a memcpy's
    speed in an engine process here)."""

    blocks: np.ndarray
    chunks: np.ndarray
    pages: np.ndarray

    def copy(
        self,
        kv: torch.Tensor,
        size: int,
        layer: torch.Tensor,
        device: torch.device,
        *,
        into_kv: bool,
    ) -> None:
        """kv[blocks[i], :size] = layer[chunks[i], pages[i]] (`layer`: payloads, per, size), or
        the other way round when not `into_kv`."""
        if device.type != "cpu":
            blocks, chunks, pages = (
                self._on(device, a) for a in (self.blocks, self.chunks, self.pages)
            )
            if into_kv:
                kv[blocks, :size] = layer[chunks, pages]
            else:
                layer[chunks, pages] = kv[blocks, :size]
            return
        rows, paged = kv.numpy(), layer.numpy()
        for block, chunk, page in zip(
            self.blocks.tolist(), self.chunks.tolist(), self.pages.tolist()
        ):
            if into_kv:
                np.copyto(rows[block, :size], paged[chunk, page])
            else:
                np.copyto(paged[chunk, page], rows[block, :size])

    @staticmethod
    def _on(device: torch.device, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(device)


class MappedRegion:
    """The scheduler's region, mapped here (registered with the device on CUDA)."""

    def __init__(self, ref: RegionRef, cuda: bool) -> None:
        fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_ino != ref.inode:
                raise RuntimeError("prefixd spec: the scheduler's region is not the one named")
            self._mmap = mmap.mmap(fd, ref.size)
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)
        self.bytes = torch.frombuffer(self.view, dtype=torch.uint8)
        self.pinned = cuda and pin_with_cuda(self.view)

    def close(self) -> None:
        if self.pinned:
            unpin_with_cuda(self.view)
        del self.bytes
        self.view.release()
        self._mmap.close()


class DeviceCopies:
    """The copies of one worker: its KV cache blocks (each a (num_blocks, page bytes) tensor of
    bytes), the scheduler's region mapped here, and on CUDA the stream the copies go on.
    `warn` is told, once each, what makes copies slower or leaves chunks out."""

    def __init__(self, blocks: list[torch.Tensor], warn: Callable[[str], None]) -> None:
        self.blocks = blocks
        self.device = blocks[0].device if blocks else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None  # type: ignore[no-untyped-call]
        self._mapped: dict[int, MappedRegion] = {}
        self._warn = warn

    @contextlib.contextmanager
    def queued(self) -> Iterator[None]:
        """On CUDA: the copies go on the spec's stream, after what the engine's stream has
        queued until now (the blocks it wrote, the blocks it allocated)."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield

    def record(self) -> Any:
        """An event after the copies queued so far (None on the CPU, where they are done)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return event

    def install(
        self, layout: Layout, block_ids: np.ndarray, skip: int, held: list[HeldPayload]
    ) -> int:
        """Copy the KV cache blocks `block_ids` from chunk payloads `held`, the first block being
        page `skip` of the first chunk; the bytes copied."""
        per = layout.per
        subs = np.arange(skip, skip + len(block_ids))
        nbytes = 0
        for j0, payloads in self._runs(held, layout.nbytes):
            k = payloads.shape[0]
            mine = (subs // per >= j0) & (subs // per < j0 + k)
            places = Places(block_ids[mine], subs[mine] // per - j0, subs[mine] % per)
            source = payloads.to(self.device, non_blocking=True) if self.cuda else payloads
            for tensor, size, layer in layout.layers(source):
                places.copy(self.blocks[tensor], size, layer, self.device, into_kv=True)
                nbytes += len(places.blocks) * size
        return nbytes

    def gather(
        self, view: memoryview, blocks: np.ndarray, layout: Layout
    ) -> tuple[torch.Tensor, ...]:
        """Queue (CUDA) or make (CPU) the copy of chunks (rows of `blocks`, each `per` block
        ids) into `view`; the tensors the copy uses, to keep until it ran."""
        k, size = int(blocks.shape[0]), layout.nbytes
        host = torch.frombuffer(view, dtype=torch.uint8)[: k * size].view(k, size)
        target = (
            torch.empty((k, size), dtype=torch.uint8, device=self.device) if self.cuda else host
        )
        places = Places(
            blocks.reshape(-1), np.arange(k).repeat(layout.per), np.tile(np.arange(layout.per), k)
        )
        for tensor, page, layer in layout.layers(target):
            places.copy(self.blocks[tensor], page, layer, self.device, into_kv=False)
        if self.cuda:
            host.copy_(target, non_blocking=True)
        return host, target

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()
        self.blocks.clear()

    def _runs(self, held: list[HeldPayload], size: int) -> Iterator[tuple[int, torch.Tensor]]:
        """The payloads `held` as runs lying back to back in one region: (index of the run's
        first payload, its payloads (k, size) in the region)."""
        start = 0
        while start < len(held):
            ref, offset, length = held[start]
            if length != size:
                raise RuntimeError(
                    f"prefixd spec: a held payload is {length} bytes, this layout's {size}"
                )
            end = start + 1
            while (
                end < len(held)
                and held[end][0] == ref
                and held[end][1] == offset + (end - start) * size
                and held[end][2] == size
            ):
                end += 1
            region = self._map(ref)
            yield (
                start,
                region.bytes[offset : offset + (end - start) * size].view(end - start, size),
            )
            start = end

    def _map(self, ref: RegionRef) -> MappedRegion:
        mapped = self._mapped.get(ref.inode)
        if mapped is None:
            if self._mapped and self._stream is not None:
                self._stream.synchronize()  # no copy queued from a region is left when it goes
            for older in self._mapped.values():  # a new region: the scheduler reconnected
                older.close()
            self._mapped = {ref.inode: MappedRegion(ref, self.cuda)}
            mapped = self._mapped[ref.inode]
            if self.cuda and not mapped.pinned:
                self._warn("the scheduler's region could not be registered: loads are slower")
        return mapped


__all__ = ["DeviceCopies", "HeldPayload", "Layout", "MappedRegion", "Places"]
