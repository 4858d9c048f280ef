"""Between the local store and a shared tier: write-behind, read-through, purges, and counts.

* Write-behind: a published block is queued and offered to the shared tier by a thread of its own;
  the engine never waits for the network. A full queue drops (and counts) the oldest work first.
* Read-through: a local miss asks the shared tier for the blocks after the local prefix, along
  the chain, a batch of them per round trip straight into one buffer (Mooncake's batch get);
  each fetched value is proven (prefixd.cluster.blocks: the right identity, parent and token ids,
  the payload's origin checksum), installed in the local store, and only then served (the local
  store verifies it again on every read). Three stages overlap: batch k+1 is fetched while
  batch k is proven, and batch k-1 installed. A value that fails is never installed, nor is
  anything after it, and it is counted. The benefit model decides first: blocks are fetched only
  when the estimated fetch time beats the prefill they save.
* Purges: removing a tenant or retiring a model version removes its objects from the tier too.
* The tier being down or slow never reaches the engine: every failure is counted and the local
  store answers alone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from enum import Enum
from typing import Final, Protocol

from prefixd.cluster.blocks import block_key, decode_block, encode_block, identity_prefix
from prefixd.errors import PrefixdError, RemoteBlockError
from prefixd.loadtime import LoadTimeModel
from prefixd.schema.chain import BlockChain
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import TokenIds
from prefixd.store import Store

log = logging.getLogger(__name__)


class _Stop(Enum):
    """The publish queue's end marker (an Enum member, so `item is _STOP` narrows the item)."""

    STOP = 0


_STOP: Final = _Stop.STOP
_BACKOFF_S = 1.0  # after a failure, publishing pauses this long before the next try
_BATCH_BYTES = 32 << 20  # fetched per round trip (and installed per local transaction), about
_MAX_BATCH = 64  # blocks per batch at most


class TierClient(Protocol):
    """What the bridge needs of a shared tier (prefixd.cluster.mooncake.SharedTier has it)."""

    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def size(self, key: str) -> int | None: ...

    def get_into(self, key: str, buffer: bytearray) -> int | None: ...

    def get_many_into(
        self, keys: Sequence[str], buffer: bytearray, capacity: int
    ) -> list[int | None]: ...

    @property
    def in_flight(self) -> int: ...

    def remove_prefix(self, prefix: str) -> int: ...

    def close(self) -> None: ...


class SharedTierBridge:
    """Write-behind and read-through between one store and one shared tier."""

    def __init__(
        self,
        store: Store,
        tier: TierClient,
        *,
        pending: int,
        prefill_tokens_per_s: float,
        max_fetch_blocks: int = 4096,
    ) -> None:
        self.store = store
        self.tier = tier
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.max_fetch_blocks = max_fetch_blocks
        self.fetch_time = LoadTimeModel(overhead_s=2e-3, bandwidth=1e9)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, bytes] | _Stop] = queue.Queue(maxsize=pending)
        self._stopping = threading.Event()
        self._held: list[bytearray] = []  # buffers a timed-out fetch may still write into
        self._thread = threading.Thread(target=self._publish_loop, name="prefixd-tier", daemon=True)
        self._installer = ThreadPoolExecutor(1, thread_name_prefix="prefixd-install")
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="prefixd-fetch")

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop publishing (what is still queued after `timeout_s` is dropped), then close."""
        deadline = time.monotonic() + timeout_s
        while not self._queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)  # let the queue drain while the tier answers
        self._stopping.set()
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            self._count("publish_dropped", self._queue.qsize())
        self._thread.join(timeout_s)
        self._fetcher.shutdown(wait=True)
        self._installer.shutdown(wait=True)
        self.tier.close()

    # --- write-behind -----------------------------------------------------------------------------

    def published(self, identity: Identity, hashes: Sequence[bytes]) -> None:
        """Queue blocks a put stored (never blocks: a full queue drops and counts)."""
        if identity.state is not None:
            return  # state groups stay local
        for block in hashes:
            try:
                self._queue.put_nowait((identity.digest, block))
            except queue.Full:
                self._count("publish_dropped")

    def _publish_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP or self._stopping.is_set():
                if item is not _STOP:
                    self._count("publish_dropped", 1 + self._queue.qsize())
                return
            digest, block = item
            try:
                exported = self.store.export_block(block)
                if exported is None:
                    continue  # evicted or removed since
                value = encode_block(exported.record, exported.payload)
                self.tier.put(block_key(digest, block), value)
            except PrefixdError as exc:
                self._count("publish_errors")
                log.warning("publishing to the shared tier failed: %s", exc)
                self._stopping.wait(_BACKOFF_S)
            else:
                self._count("published_blocks")

    # --- read-through ----------------------------------------------------------------------------

    def read_through(self, identity: Identity, token_ids: TokenIds, local_blocks: int) -> int:
        """Fetch, prove and install the blocks after the first `local_blocks` from the shared
        tier, while they are there and worth it; return how many were installed."""
        if identity.state is not None:
            return 0
        chain = BlockChain(identity, token_ids)
        end = min(chain.n_blocks, local_blocks + self.max_fetch_blocks)
        if end <= local_blocks:
            return 0
        if not self._worth_it(identity, end - local_blocks):
            self._count("remote_skipped_by_benefit")
            return 0
        capacity = self._capacity(block_key(identity.digest, chain.hash(local_blocks)))
        if capacity is None:
            return 0
        per_batch = max(1, min(_MAX_BATCH, _BATCH_BYTES // capacity))
        batches = [(s, min(s + per_batch, end)) for s in range(local_blocks, end, per_batch)]
        # Three buffers at most, reused: one being fetched into, one proven, one installed.
        spare: list[bytearray] = []

        def fetch(start: int, stop: int) -> Future[tuple[list[memoryview | None], bytearray]]:
            room = spare.pop() if spare else bytearray(per_batch * capacity)
            return self._fetcher.submit(self._fetch, identity, chain, start, stop, capacity, room)

        installed = expected = 0
        pending: Future[int] | None = None  # the install of the batch before
        installing = bytearray()  # its buffer
        fetching = fetch(*batches[0])
        for index, (start, stop) in enumerate(batches):
            values, room = fetching.result()
            whole = len(values) == stop - start and None not in values
            if whole and index + 1 < len(batches):  # the next round trip, while this is proven
                fetching = fetch(*batches[index + 1])
            batch = self._proven(identity, chain, start, values)
            if pending is not None:
                done = pending.result()
                installed += done
                pending = None
                spare.append(installing)
                if done < expected:
                    batch = []  # the install before failed: nothing after it can go in
            if batch:
                expected = len(batch)
                pending = self._installer.submit(self._install, identity, chain, start, batch)
                installing = room
            elif values:  # not a failed fetch, whose buffer the tier may still write into
                spare.append(room)
            if len(batch) < stop - start:
                break
        if not fetching.cancel():
            fetching.result()  # a batch fetched ahead and not needed: no call outlives this one
        if pending is not None:
            installed += pending.result()
        self._count("remote_hit_blocks", installed)
        return installed

    def _capacity(self, key: str) -> int | None:
        """Room for one value of a batch: the first one's size, with some slack (the values of
        one identity are about the same size; a longer one is fetched alone)."""
        try:
            size = self.tier.size(key)
        except PrefixdError as exc:
            self._count("fetch_errors")
            log.warning("fetching from the shared tier failed: %s", exc)
            return None
        if size is None:
            self._count("remote_misses")
            return None
        return size + size // 16 + 64

    def _fetch(
        self,
        identity: Identity,
        chain: BlockChain,
        start: int,
        stop: int,
        capacity: int,
        buffer: bytearray,
    ) -> tuple[list[memoryview | None], bytearray]:
        """The values of blocks [start, stop) in one round trip into `buffer`, up to the first
        one missing (then None); [] when the tier fails. Runs on the fetcher thread."""
        keys = [block_key(identity.digest, chain.hash(i)) for i in range(start, stop)]
        started = time.perf_counter()
        try:
            lengths = self.tier.get_many_into(keys, buffer, capacity)
            view = memoryview(buffer)
            values: list[memoryview | None] = []
            for i, n in enumerate(lengths):
                if n is None:
                    value = None
                elif n < 0:  # longer than the room for it: alone
                    value = self._get(keys[i])
                else:
                    value = view[i * capacity : i * capacity + n]
                values.append(value)
                if value is None:
                    self._count("remote_misses")
                    break
        except PrefixdError as exc:
            with self._lock:
                self._held.append(buffer)  # a call that timed out may still write into it
            self._count("fetch_errors")
            log.warning("fetching from the shared tier failed: %s", exc)
            return [], buffer
        finally:
            self._release_held()
        got = sum(v.nbytes for v in values if v is not None)
        self.fetch_time.observe(got, time.perf_counter() - started)
        return values, buffer

    def _proven(
        self, identity: Identity, chain: BlockChain, start: int, values: list[memoryview | None]
    ) -> list[memoryview]:
        """The payloads of `values` (blocks from `start`) proven to be these blocks, up to the
        first that is absent or fails."""
        payloads: list[memoryview] = []
        for index, value in enumerate(values, start):
            if value is None:
                break
            try:
                payloads.append(
                    decode_block(
                        value,
                        identity_digest=identity.digest,
                        parent=chain.parent_of(index),
                        tokens=bytes(chain.block_bytes(index)),
                    )
                )
            except RemoteBlockError as exc:
                self._count("remote_verify_failures")
                log.warning("a block from the shared tier failed verification: %s", exc)
                break
        return payloads

    def _get(self, key: str) -> memoryview | None:
        """The value under `key`, sized first, then fetched straight into a buffer of its own
        (the tier's plain get goes through a staging copy). A buffer whose fetch failed is kept
        until the tier lets go of it: a call that timed out may still write into it."""
        size = self.tier.size(key)
        if size is None:
            return None
        buffer = bytearray(size)
        try:
            n = self.tier.get_into(key, buffer)
        except PrefixdError:
            with self._lock:
                self._held.append(buffer)
            raise
        finally:
            self._release_held()
        return None if n is None else memoryview(buffer)[:n]

    def _release_held(self) -> None:
        with self._lock:
            if self._held and not self.tier.in_flight:
                self._held.clear()

    def _install(
        self, identity: Identity, chain: BlockChain, first: int, batch: list[memoryview]
    ) -> int:
        """Put a run of proven payloads in the local store in one transaction; empties `batch`
        on success and returns how many were installed."""
        try:
            self.store.put(identity, chain.tokens, batch, first_block=first)
        except PrefixdError as exc:
            self._count("install_errors")
            log.warning("installing blocks from the shared tier failed: %s", exc)
            return 0
        n = len(batch)
        self._count("remote_bytes", sum(p.nbytes for p in batch))
        batch.clear()
        return n

    def _worth_it(self, identity: Identity, blocks: int) -> bool:
        """Whether fetching `blocks` blocks beats prefilling their tokens, by the fetch model
        and the local bytes per block of this store (the mean of what it holds)."""
        stats = self.store.stats()
        per_block = stats.payload_bytes / stats.blocks if stats.blocks else 0.0
        fetch_s = self.fetch_time.estimate(int(per_block * blocks)) if per_block else 0.0
        saved_s = blocks * identity.block_tokens / self.prefill_tokens_per_s
        return fetch_s < saved_s

    # --- purges ----------------------------------------------------------------------------------

    def purged(self, digests: Iterable[bytes]) -> int:
        """Remove the tier's objects of identities removed whole from the local store."""
        removed = 0
        for digest in digests:
            try:
                removed += self.tier.remove_prefix(identity_prefix(digest))
            except PrefixdError as exc:
                self._count("purge_errors")
                log.warning("removing purged objects from the shared tier failed: %s", exc)
        self._count("remote_purged_objects", removed)
        return removed

    # --- counts ---------------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self.counts)
        counts["publish_queued"] = self._queue.qsize()
        return counts
