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

import contextlib
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from prefixd.client import Client
from prefixd.client.leases import Lease
from prefixd.integrations.vllm.compat import blocks_of
from prefixd.integrations.vllm.jobs import PrefixdLoadSpec, PrefixdStoreSpec
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
        self._kv_caches = kv_caches
        self._device = self._blocks[0].device if self._blocks else torch.device("cpu")
        self._cuda = self._device.type == "cuda"
        self._stream = torch.cuda.Stream(self._device) if self._cuda else None  # type: ignore[no-untyped-call]
        self._link = settings.link(
            f"vllm-spec-worker-{self._rank}", "prefixd spec worker", settings.store_region_bytes
        )
        self._attached: dict[int, _Attached] = {}
        self._warned: set[str] = set()
        self._copying: list[tuple[TransferResult, float, Any]] = []  # loads copying on CUDA
        self._puts: queue.SimpleQueue[_StoreJob | None] = queue.SimpleQueue()
        self._finished: list[TransferResult] = []
        self._pending: set[int] = set()  # store jobs on the put thread
        self._done = threading.Condition()
        self._thread = threading.Thread(
            target=self._put_jobs, name="prefixd-spec-puts", daemon=True
        )
        self._thread.start()

    # --- vLLM's calls (its worker thread: copies are queued or made here, puts on a thread) ----

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        """`src_spec`: the KV cache's blocks (compat.blocks_of reads every release's kind)."""
        assert isinstance(dst_spec, PrefixdStoreSpec)
        job = _StoreJob(job_id, time.perf_counter())
        try:
            with self._copy_stream():
                job.puts = self._gather(src_spec, dst_spec)
                job.copied = self._record()
        except Exception:  # a store that fails is a miss later, never vLLM's problem
            log.exception("prefixd spec: a store job failed")
            job.release()
        with self._done:
            self._pending.add(job_id)
        self._puts.put(job)
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any, expedited: bool = False
    ) -> bool:
        """`dst_spec`: the KV cache's blocks (compat.blocks_of); `expedited` (vLLM 0.34): every
        load here is done, or queued on the device, before this returns."""
        assert isinstance(src_spec, PrefixdLoadSpec)
        started = time.perf_counter()
        try:
            with self._copy_stream():
                nbytes = self._load(dst_spec, src_spec)
                copied = self._record()
        except Exception:  # every byte named is held verified in memory: only a bug gets here
            log.exception("prefixd spec: a load job failed")
            self._finish(TransferResult(job_id, False, 0, time.perf_counter() - started))
            return True
        result = TransferResult(job_id, True, nbytes, time.perf_counter() - started)
        if copied is None:
            self._finish(result)
        else:
            with self._done:
                self._copying.append((result, started, copied))
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._done:
            still = []
            for result, started, copied in self._copying:
                if copied.query():
                    result.transfer_time = time.perf_counter() - started
                    self._finished.append(result)
                else:
                    still.append((result, started, copied))
            self._copying = still
            finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        with self._done:
            copying = [copied for result, _, copied in self._copying if result.job_id in job_ids]
        for copied in copying:
            copied.synchronize()
        with self._done:
            self._done.wait_for(lambda: not (self._pending & job_ids))

    def shutdown(self) -> None:
        self._puts.put(None)
        self._thread.join()
        if self._stream is not None:
            self._stream.synchronize()
        self._link.close()
        for attached in self._attached.values():
            attached.close()
        self._attached.clear()
        self._blocks.clear()

    # --- copies ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _copy_stream(self) -> Iterator[None]:
        """On CUDA: the copies go on the spec's stream, after what the engine's stream has
        queued until now (the blocks it wrote, the blocks it allocated)."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            yield

    def _record(self) -> Any:
        """An event after the copies queued so far (None on the CPU, where they are done)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return event

    def _finish(self, result: TransferResult) -> None:
        with self._done:
            self._pending.discard(result.job_id)
            self._finished.append(result)
            self._done.notify_all()

    def _groups(self, device: Any) -> Iterator[tuple[int, np.ndarray, int]]:
        """Each group with blocks in the job: its index, its block ids and its first block's
        index in the request."""
        job = blocks_of(device, self._kv_caches)
        at = 0
        for index, (size, first) in enumerate(zip(job.group_sizes, job.block_indices, strict=True)):
            if size:
                yield index, job.block_ids[at : at + size], int(first)
            at += size

    def _load(self, gpu: Any, spec: PrefixdLoadSpec) -> int:
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
            if self._cuda and not attached.pinned:
                self._warn_once("the scheduler's region could not be registered: loads are slower")
        return attached

    def _gather(self, gpu: Any, spec: PrefixdStoreSpec) -> list[_Put]:
        """Copy the job's chunks from the KV cache into leases of this worker's region, in runs
        of consecutive chain places (each run one lease, taken without waiting: a region full of
        stores still on their way skips the rest, logged)."""
        client = self._link.client()
        if client is None:
            return []  # the daemon is away (logged): nothing to put
        if self._cuda and client.region is not None and not client.region.pin():
            self._warn_once("the store region could not be registered: stores copy synchronously")
        by_group = {g.group: g for g in spec.groups}
        puts: list[_Put] = []
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
            blocks = block_ids.reshape(-1, layout.per)
            per_lease = max(1, client.region.size // layout.nbytes) if client.region else 1
            for run in _consecutive(list(enumerate(group.places)), per_lease):
                rows = [i for i, _ in run]
                lease = client.try_reserve(len(run) * layout.nbytes)
                if lease is None:
                    self._warn_once("the store region is full: chunks are left unstored")
                    return puts
                keep = self._copy_out(lease, blocks[rows], layout)
                identity, chain = self._identities[group.group], group.chain[: run[-1][1] + 1]
                puts.append(_Put(lease, identity, chain, run[0][1], len(run), layout.nbytes, keep))
        return puts

    def _copy_out(
        self, lease: Lease, blocks: np.ndarray, layout: Layout
    ) -> tuple[torch.Tensor, ...]:
        """Queue (CUDA) or make (CPU) the copy of chunks (rows of `blocks`) into `lease`; the
        tensors the copy uses, to keep until it ran."""
        k, size = int(blocks.shape[0]), layout.nbytes
        host = torch.frombuffer(lease.view, dtype=torch.uint8)[: k * size].view(k, size)
        target = (
            torch.empty((k, size), dtype=torch.uint8, device=self._device) if self._cuda else host
        )
        places = Places(
            blocks.reshape(-1), np.arange(k).repeat(layout.per), np.tile(np.arange(layout.per), k)
        )
        for tensor, page, layer in layout.layers(target):
            places.gather(self._blocks[tensor], page, layer, self._device)
        if self._cuda:
            host.copy_(target, non_blocking=True)
        return host, target

    def _put_jobs(self) -> None:
        """The put thread: each store job's runs, once their copies are done, less the chunks
        the daemon holds already."""
        self._link.client()  # at once, off vLLM's thread: the region is made before any store
        while (job := self._puts.get()) is not None:
            nbytes = 0
            try:
                if job.copied is not None:
                    job.copied.synchronize()
                for put in job.puts:
                    done = self._link.call(lambda c: self._put(c, put))  # noqa: B023
                    if done is None:
                        break  # refused (say, a parent not stored) or the daemon is away: logged
                    nbytes += done
            except Exception:
                log.exception("prefixd spec: a store job failed")
            finally:
                job.release()
            self._finish(
                TransferResult(job.job_id, True, nbytes, time.perf_counter() - job.started)
            )

    def _put(self, client: Client, put: _Put) -> int:
        """Put the run's chunks the daemon does not hold yet; the bytes put."""
        words = pack_keys(put.identity, put.chain)
        [found] = client.lookup(put.identity, [words], stored_only=True)
        skip = max(0, found.n_blocks - put.first)
        if skip >= put.count:
            return 0
        spans = [(put.lease.offset + i * put.size, put.size) for i in range(skip, put.count)]
        client.put_spans(put.identity, words, spans, first_block=put.first + skip)
        return (put.count - skip) * put.size

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("prefixd spec: %s", message)


@dataclass
class _Put:
    """One run of a store job: `count` chunks of `size` bytes in `lease`, chain places `first`
    on, of the chain `chain` under `identity`; `keep` holds the copy's tensors until it ran."""

    lease: Lease
    identity: Identity
    chain: tuple[bytes, ...]
    first: int
    count: int
    size: int
    keep: tuple[torch.Tensor, ...]


@dataclass
class _StoreJob:
    job_id: int
    started: float
    puts: list[_Put] = field(default_factory=list)
    copied: Any = None  # the CUDA event after the copies

    def release(self) -> None:
        for put in self.puts:
            put.keep = ()
            put.lease.release()
        self.puts = []


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
