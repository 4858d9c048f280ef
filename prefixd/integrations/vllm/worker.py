"""The direct spec's worker side: chunks between the KV cache and prefixd's shared regions.

A load copies payloads the scheduler holds verified in its region straight into the KV cache's
blocks; a store gathers a chunk's blocks straight from the KV cache into a lease of this worker's
own region and puts it from there. The copies themselves (copies.py) know nothing of vLLM: on
CUDA they run on a stream of their own from registered regions, without CUDA on the CPU. Copies
are made or queued on vLLM's worker thread, puts on a thread of their own; vLLM polls for jobs.

vLLM's connector cannot take a failed load back (it stops the engine), and every load names
payloads already verified in memory, so a load fails only on a bug. A store that the daemon
refuses or cannot take is logged and reported done: the chunk is then a miss, never wrong bytes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
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
from prefixd.integrations.vllm.copies import DeviceCopies, Layout
from prefixd.integrations.vllm.jobs import PrefixdLoadSpec, PrefixdStoreSpec
from prefixd.integrations.vllm.settings import Settings
from prefixd.schema.identity import Identity
from prefixd.schema.keys import pack_keys

log = logging.getLogger(__name__)


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
        self._kv_caches = kv_caches
        self._warned: set[str] = set()
        # each (num_blocks, page bytes), as vLLM's connector hands them, seen as bytes
        blocks = [kv.tensor.view(torch.uint8) for kv in kv_caches.tensors]
        self._copies = DeviceCopies(blocks, self._warn_once)
        self._link = settings.link(
            f"vllm-spec-worker-{self._rank}", "prefixd spec worker", settings.store_region_bytes
        )
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
            with self._copies.queued():
                job.puts = self._gather(src_spec, dst_spec)
                job.copied = self._copies.record()
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
            with self._copies.queued():
                nbytes = self._load(dst_spec, src_spec)
                copied = self._copies.record()
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
        self._copies.close()
        self._link.close()

    # --- jobs ----------------------------------------------------------------------------------

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
            skip = first % layout.per  # pages of the group's first chunk before the load's first
            n_chunks = -(-(skip + len(block_ids)) // layout.per)
            held = [spec.chunks[chunk_at + j][self._rank] for j in range(n_chunks)]
            chunk_at += n_chunks
            nbytes += self._copies.install(layout, block_ids, skip, held)
        return nbytes

    def _gather(self, gpu: Any, spec: PrefixdStoreSpec) -> list[_Put]:
        """Copy the job's chunks from the KV cache into leases of this worker's region, in runs
        of consecutive chain places (each run one lease, taken without waiting: a region full of
        stores still on their way skips the rest, logged)."""
        client = self._link.client()
        if client is None:
            return []  # the daemon is away (logged): nothing to put
        if self._copies.cuda and client.region is not None and not client.region.pin():
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
                keep = self._copies.gather(lease.view, blocks[rows], layout)
                identity, chain = self._identities[group.group], group.chain[: run[-1][1] + 1]
                puts.append(_Put(lease, identity, chain, run[0][1], len(run), layout.nbytes, keep))
        return puts

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
        # the lease may be another client's: taken before a reconnect, its offsets could name
        # another job's lease in this client's region, whose bytes would be stored as this one's
        client.put_spans(put.identity, words, spans, first_block=put.first + skip, lease=put.lease)
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


__all__ = ["PrefixdWorker"]
