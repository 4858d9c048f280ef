"""The direct spec's worker side: chunks between the KV cache and prefixd's shared regions.

A load copies payloads the scheduler holds verified in its region (mapped here through /proc, the
inode checked) straight into the KV cache's blocks; a store gathers a chunk's blocks straight from
the KV cache into a lease of this worker's own region and puts it from there. A chunk's payload is
its group's layers in order, each layer's `blocks_per_chunk` pages of that layer's bytes. On CUDA
the regions are registered with the device, each run of payloads crosses in one copy on a side
stream, and the pages are scattered or gathered on the device; without CUDA the same path copies
on the CPU. Jobs run on one thread, in order; vLLM polls for them.

vLLM's connector cannot take a failed load back (it stops the engine), and every load names
payloads already verified in memory, so a load fails only on a bug. A store that the daemon
refuses or cannot take is logged and reported done: the chunk is then a miss, never wrong bytes.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from prefixd.client import Client
from prefixd.client.operations import put_spans, reserve
from prefixd.integrations.link import DaemonLink
from prefixd.integrations.vllm.jobs import PrefixdLoadSpec, PrefixdStoreSpec, StoreGroup
from prefixd.integrations.vllm.settings import Settings
from prefixd.integrations.vllm.staging import RegionRef
from prefixd.schema.identity import Identity
from prefixd.schema.keys import pack_keys
from prefixd.wire.region import pin_with_cuda, unpin_with_cuda

log = logging.getLogger(__name__)


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

    def install(
        self, kv: torch.Tensor, size: int, layer: torch.Tensor, device: torch.device
    ) -> None:
        """kv[blocks[i], :size] = layer[chunks[i], pages[i]] (`layer`: payloads, per, size)."""
        if device.type != "cpu":
            kv[self._on(device, self.blocks), :size] = layer[
                self._on(device, self.chunks), self._on(device, self.pages)
            ]
            return
        rows, pages = kv.numpy(), layer.numpy()
        for block, chunk, page in zip(
            self.blocks.tolist(), self.chunks.tolist(), self.pages.tolist()
        ):
            np.copyto(rows[block, :size], pages[chunk, page])

    def gather(
        self, kv: torch.Tensor, size: int, layer: torch.Tensor, device: torch.device
    ) -> None:
        """layer[chunks[i], pages[i]] = kv[blocks[i], :size]."""
        if device.type != "cpu":
            layer[self._on(device, self.chunks), self._on(device, self.pages)] = kv[
                self._on(device, self.blocks), :size
            ]
            return
        rows, pages = kv.numpy(), layer.numpy()
        for block, chunk, page in zip(
            self.blocks.tolist(), self.chunks.tolist(), self.pages.tolist()
        ):
            np.copyto(pages[chunk, page], rows[block, :size])

    @staticmethod
    def _on(device: torch.device, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(device)


class _Attached:
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


class PrefixdWorker(OffloadingWorker):  # type: ignore[misc]
    """The OffloadingWorker of PrefixdOffloadingSpec (see the module's docstring)."""

    def __init__(
        self,
        config: OffloadingConfig,
        settings: Settings,
        identities: list[dict[int, Identity]],
        kv_caches: CanonicalKVCaches,
    ) -> None:
        self._rank = config.parallel.rank
        self._identities = identities[self._rank]
        per = config.cache.blocks_per_chunk
        self._group_ids = [g.group_id for g in config.groups]
        self._layouts = [Layout.of(refs, per) for refs in kv_caches.group_data_refs]
        # each (num_blocks, page bytes), as vLLM's connector hands them, seen as bytes
        self._blocks = [kv.tensor.view(torch.uint8) for kv in kv_caches.tensors]
        self._device = self._blocks[0].device if self._blocks else torch.device("cpu")
        self._cuda = self._device.type == "cuda"
        self._stream = torch.cuda.Stream(self._device) if self._cuda else None  # type: ignore[no-untyped-call]
        self._link = DaemonLink(
            settings.socket,
            region_bytes=settings.store_region_bytes,
            timeout_s=settings.timeout_s,
            name=f"vllm-spec-worker-{self._rank}",
            label="prefixd spec worker",
            reconnect_s=settings.reconnect_s,
            daemon_uid=settings.daemon_uid,
        )
        self._attached: dict[int, _Attached] = {}
        self._warned: set[str] = set()
        self._jobs: queue.SimpleQueue[tuple[int, bool, Any, Any, Any] | None] = queue.SimpleQueue()
        self._finished: list[TransferResult] = []
        self._pending: set[int] = set()
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="prefixd-spec-jobs", daemon=True)
        self._thread.start()

    # --- vLLM's calls ---------------------------------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, PrefixdStoreSpec)
        self._submit(job_id, True, src_spec, dst_spec)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, PrefixdLoadSpec)
        self._submit(job_id, False, dst_spec, src_spec)
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._done:
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        with self._done:
            self._done.wait_for(lambda: not (self._pending & job_ids))

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        self._link.close()
        for attached in self._attached.values():
            attached.close()
        self._attached.clear()
        self._blocks.clear()

    # --- the job thread -------------------------------------------------------------------------

    def _submit(self, job_id: int, store: bool, gpu: GPULoadStoreSpec, ours: Any) -> None:
        ready = None
        if self._cuda:  # the copies wait for what the engine's stream has queued until now
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(torch.cuda.current_stream(self._device))
        with self._done:
            self._pending.add(job_id)
        self._jobs.put((job_id, store, gpu, ours, ready))

    def _work(self) -> None:
        self._link.client()  # at once, off vLLM's thread: the region is made before any store
        while (job := self._jobs.get()) is not None:
            job_id, store, gpu, ours, ready = job
            started = time.perf_counter()
            success = True
            try:
                if self._stream is not None:
                    self._stream.wait_event(ready)
                    with torch.cuda.stream(self._stream):
                        nbytes = self._store(gpu, ours) if store else self._load(gpu, ours)
                    self._stream.synchronize()
                else:
                    nbytes = self._store(gpu, ours) if store else self._load(gpu, ours)
            except Exception:
                # A store's failure is a miss later; a load's is a bug, and vLLM stops on it.
                log.exception("prefixd spec: a %s job failed", "store" if store else "load")
                nbytes, success = 0, store
            result = TransferResult(job_id, success, nbytes, time.perf_counter() - started)
            with self._done:
                self._pending.discard(job_id)
                self._finished.append(result)
                self._done.notify_all()

    def _groups(self, gpu: GPULoadStoreSpec) -> Iterator[tuple[int, np.ndarray, int]]:
        """Each group with blocks in the job: its index, its block ids and its first block's
        index in the request."""
        at = 0
        for index, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if size:
                yield index, gpu.block_ids[at : at + size].astype(np.int64), int(first)
            at += size

    def _load(self, gpu: GPULoadStoreSpec, spec: PrefixdLoadSpec) -> int:
        nbytes = 0
        chunk_at = 0
        for index, block_ids, first in self._groups(gpu):
            layout = self._layouts[index]
            per = layout.per
            skip = first % per  # pages of the group's first chunk before the load's first block
            subs = np.arange(skip, skip + len(block_ids))
            n_chunks = -(-(skip + len(block_ids)) // per)
            entries = [spec.chunks[chunk_at + j][self._rank] for j in range(n_chunks)]
            chunk_at += n_chunks
            for j0, payloads in self._runs(entries, layout.nbytes):
                k = payloads.shape[0]
                mine = (subs // per >= j0) & (subs // per < j0 + k)
                places = Places(block_ids[mine], subs[mine] // per - j0, subs[mine] % per)
                source = payloads.to(self._device, non_blocking=True) if self._cuda else payloads
                for tensor, size, layer in layout.layers(source):
                    places.install(self._blocks[tensor], size, layer, self._device)
                    nbytes += len(places.blocks) * size
        return nbytes

    def _runs(
        self, entries: list[tuple[RegionRef, int, int]], size: int
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """The payloads of `entries` as runs lying back to back in one region: (index of the
        run's first entry, its payloads (k, size) in the region)."""
        start = 0
        while start < len(entries):
            ref, offset, length = entries[start]
            if length != size:
                raise RuntimeError(
                    f"prefixd spec: a held payload is {length} bytes, this layout's {size}"
                )
            end = start + 1
            while (
                end < len(entries)
                and entries[end][0] == ref
                and entries[end][1] == offset + (end - start) * size
                and entries[end][2] == size
            ):
                end += 1
            region = self._attach(ref)
            yield (
                start,
                region.bytes[offset : offset + (end - start) * size].view(end - start, size),
            )
            start = end

    def _attach(self, ref: RegionRef) -> _Attached:
        attached = self._attached.get(ref.inode)
        if attached is None:
            for older in self._attached.values():  # a new region: the scheduler reconnected
                older.close()
            self._attached = {ref.inode: _Attached(ref, self._cuda)}
            attached = self._attached[ref.inode]
        return attached

    def _store(self, gpu: GPULoadStoreSpec, spec: PrefixdStoreSpec) -> int:
        by_group = {g.group: g for g in spec.groups}
        nbytes = 0
        for index, block_ids, first in self._groups(gpu):
            group = by_group.get(self._group_ids[index])
            layout = self._layouts[index]
            if (
                group is None
                or first % layout.per
                or len(block_ids) != len(group.places) * layout.per
            ):
                self._warn_once(
                    "a store of partial chunks (a sliding window's or a null block's) is skipped"
                )
                continue
            identity = self._identities[group.group]
            nbytes += self._store_group(identity, group, block_ids.reshape(-1, layout.per), layout)
        return nbytes

    def _store_group(
        self, identity: Identity, group: StoreGroup, blocks: np.ndarray, layout: Layout
    ) -> int:
        """Put `group`'s chunks (rows of `blocks`) the daemon does not hold yet, in runs of
        consecutive chain places, each run within this worker's region."""
        words = pack_keys(identity, group.chain)
        found = self._link.call(lambda c: c.lookup(identity, [words], stored_only=True))
        if found is None:
            return 0
        have = found[0].n_blocks
        wanted = [(i, place) for i, place in enumerate(group.places) if place >= have]
        client = self._link.client()
        if client is None or not wanted:
            return 0
        per_call = max(1, client.region.size // layout.nbytes) if client.region else 1
        nbytes = 0
        for run in _consecutive(wanted, per_call):
            rows = [i for i, _ in run]
            first = run[0][1]
            chain = pack_keys(identity, group.chain[: first + len(run)])
            done = self._link.call(
                lambda c: self._put(c, identity, chain, first, blocks[rows], layout)  # noqa: B023
            )
            if done is None:
                break  # refused (say, a parent not stored) or the daemon is away: logged
            nbytes += done
        return nbytes

    def _put(
        self,
        client: Client,
        identity: Identity,
        chain: bytes,
        first: int,
        blocks: np.ndarray,
        layout: Layout,
    ) -> int:
        k = int(blocks.shape[0])
        size = layout.nbytes
        with client.run(reserve, k * size) as lease:
            host = torch.frombuffer(lease.view, dtype=torch.uint8)[: k * size].view(k, size)
            target = (
                torch.empty((k, size), dtype=torch.uint8, device=self._device)
                if self._cuda
                else host
            )
            rows = np.arange(k).repeat(layout.per)
            places = Places(blocks.reshape(-1), rows, np.tile(np.arange(layout.per), k))
            for tensor, page, layer in layout.layers(target):
                places.gather(self._blocks[tensor], page, layer, self._device)
            if self._cuda:
                host.copy_(target, non_blocking=True)
                assert self._stream is not None
                self._stream.synchronize()
            del host, target
            spans = [(lease.offset + i * size, size) for i in range(k)]
            client.run(put_spans, identity, chain, spans, first_block=first)
        return k * size

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("prefixd spec: %s", message)


def _consecutive(wanted: list[tuple[int, int]], most: int) -> Iterator[list[tuple[int, int]]]:
    """`wanted` (row, place) cut into runs of consecutive places, at most `most` long."""
    run: list[tuple[int, int]] = []
    for row, place in wanted:
        if run and (place != run[-1][1] + 1 or len(run) == most):
            yield run
            run = []
        run.append((row, place))
    if run:
        yield run


__all__ = ["Layout", "PrefixdWorker"]
