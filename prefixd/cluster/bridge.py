"""Between the local store and a shared tier: write-behind, read-through, purges, and counts.

* Write-behind: a published block is queued and offered to the shared tier by a thread of its own;
  the engine never waits for the network. A full queue drops (and counts) the oldest work first.
* Read-through: a local miss asks the shared tier for the blocks after the local prefix, one by
  one along the chain; each fetched value is proven (prefixd.cluster.blocks: the right identity,
  parent and token ids, the payload's origin checksum), installed in the local store, and only
  then served (the local store verifies it again on every read). A value that fails is never
  installed, and is counted. The benefit model decides first: blocks are fetched only when the
  estimated fetch time beats the prefill they save.
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
_INSTALL_BATCH = 16  # fetched blocks installed per local transaction


class TierClient(Protocol):
    """What the bridge needs of a shared tier (prefixd.cluster.mooncake.SharedTier has it)."""

    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def size(self, key: str) -> int | None: ...

    def get_into(self, key: str, buffer: bytearray) -> int | None: ...

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
        wanted = min(chain.n_blocks, local_blocks + self.max_fetch_blocks) - local_blocks
        if wanted <= 0:
            return 0
        if not self._worth_it(identity, wanted):
            self._count("remote_skipped_by_benefit")
            return 0
        # Batch k is installed (one local transaction) on a thread of its own while batch k+1
        # is fetched and proven here; installs stay in chain order, each after the one before.
        installed = 0
        pending: Future[int] | None = None
        expected = 0
        for start in range(local_blocks, local_blocks + wanted, _INSTALL_BATCH):
            stop = min(start + _INSTALL_BATCH, local_blocks + wanted)
            batch: list[memoryview] = []
            for index in range(start, stop):
                payload = self._fetch(identity, chain, index)
                if payload is None:
                    break
                batch.append(payload)
            if pending is not None:
                done = pending.result()
                installed += done
                pending = None
                if done < expected:
                    batch = []  # the install before failed: nothing after it can go in
            if batch:
                expected = len(batch)
                pending = self._installer.submit(self._install, identity, chain, start, batch)
            if len(batch) < stop - start:
                break
        if pending is not None:
            installed += pending.result()
        self._count("remote_hit_blocks", installed)
        return installed

    def _fetch(self, identity: Identity, chain: BlockChain, index: int) -> memoryview | None:
        """Block `index`'s payload from the tier, proven; None if absent, damaged or failing."""
        key = block_key(identity.digest, chain.hash(index))
        started = time.perf_counter()
        try:
            value = self._get(key)
        except PrefixdError as exc:
            self._count("fetch_errors")
            log.warning("fetching from the shared tier failed: %s", exc)
            return None
        if value is None:
            self._count("remote_misses")
            return None
        try:
            payload = decode_block(
                value,
                identity_digest=identity.digest,
                parent=chain.parent_of(index),
                tokens=bytes(chain.block_bytes(index)),
            )
        except RemoteBlockError as exc:
            self._count("remote_verify_failures")
            log.warning("a block from the shared tier failed verification: %s", exc)
            return None
        self.fetch_time.observe(len(value), time.perf_counter() - started)
        return payload

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
