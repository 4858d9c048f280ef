"""Between the local store and a shared tier: write-behind, read-through, purges, and counts.

Write-behind: a published block is queued and offered by a thread of its own, so the engine never
waits for the network; a full queue drops and counts, a block the tier could not be reached for or
found no room for is queued again (`_PUBLISH_TRIES` in all). Read-through: a local miss fetches the
blocks after the local prefix in batches (one round trip each), proves every value
(prefixd.cluster.blocks) and installs it; fetch, proof and install overlap. Plain identities are
served from the fetch buffers until installed (prefixd.cluster.staging). A value that fails is never
installed nor served, nor is anything after it. Blocks are fetched only when the benefit model says
the fetch beats the prefill it saves. Hybrid identities install up to the last boundary where every
page and promised checkpoint is there (`runs.closed_run`). The tier being down or slow never reaches
the engine: every failure is counted and the local store answers alone.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from enum import Enum
from functools import partial
from typing import Any, Final, Generic, Protocol, TypeAlias, TypeVar

from prefixd.cluster import runs
from prefixd.cluster.benefit import FetchBenefit
from prefixd.cluster.blocks import (
    RemoteBlock,
    block_key,
    decode_block,
    encode_block_into,
    encoded_size,
    identity_prefix,
    tenant_prefix,
)
from prefixd.cluster.staging import FetchRooms, Staging, TierBuffers, staged_load
from prefixd.errors import (
    PrefixdError,
    RemoteBlockError,
    TierFullError,
    TierTransferError,
    TierUnavailableError,
)
from prefixd.schema.chain import BlockChain
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import PromptIds
from prefixd.store import Store
from prefixd.store.purge import PurgeReport
from prefixd.store.results import ExportedBlock, LoadResult, PrefixMatch

log = logging.getLogger(__name__)
_K = TypeVar("_K")


class _Stop(Enum):
    """The publish queue's end marker (an Enum member, so `item is _STOP` narrows)."""

    STOP = 0


_STOP: Final = _Stop.STOP
_BACKOFF_S = 1.0  # after a failure, publishing pauses this long before the next try
_PUBLISH_TRIES = 3  # a block the tier was unreachable or full for goes back in the queue, so often
_BATCH_BYTES = 32 << 20  # fetched per round trip (and installed per local transaction), about
_MAX_BATCH = 64  # blocks per batch at most
_RECHECK_S = 30.0  # a hybrid prompt the tier did not extend is asked again after this long
# A fetch whose transfer failed is not made again for this long: its value is in a dead peer's
# segment, whose transfers fail after a second each until the master drops the segment
# (Mooncake's --client_ttl, 10 s by default). Other failures (a value still being put) are not
# remembered.
_REFETCH_S = 10.0
# The longest value fetched: a block of a large model at hundreds of tokens is some hundred MiB;
# a size past this is a broken or hostile value, not a block to map memory for.
MAX_VALUE_BYTES = 1 << 30
_SKIPS_KEPT = 4096  # such prompts remembered at most, of each kind
_STAGING_BYTES = 96 << 20  # a staged read-through's buffers past its three, at most
_SETTLE_S = 60.0  # a delete or purge waits this long at most for the installs queued before it
_WARN_EVERY_S = 10.0  # a failure of one kind is logged at most this often (each one is counted)

# a batch's values (None for the first one missing) in the buffer they were fetched into
Fetched: TypeAlias = tuple[list[memoryview | None], memoryview]


class TierClient(TierBuffers, Protocol):
    """What the bridge needs of a shared tier (prefixd.cluster.mooncake.SharedTier has it)."""

    def put(self, key: str, value: bytes | memoryview, *, overwrite: bool = False) -> None: ...

    def size(self, key: str) -> int | None: ...

    def get_into(self, key: str, buffer: bytearray) -> int | None: ...

    def get_many_into(
        self, keys: Sequence[str], buffer: memoryview, capacity: int
    ) -> list[int | None]: ...

    @property
    def in_flight(self) -> int: ...

    def remove_prefix(self, prefix: str) -> int: ...

    def close(self) -> None: ...


class _Skips(Generic[_K]):
    """Keys not to ask the tier for until a time each, `_SKIPS_KEPT` at most (the expired go
    first, then the oldest). Not locked: the bridge holds its lock."""

    def __init__(self) -> None:
        self._until: dict[_K, float] = {}

    def add(self, key: _K, now: float, for_s: float) -> None:
        if len(self._until) >= _SKIPS_KEPT:
            for old in [k for k, until in self._until.items() if until <= now]:
                del self._until[old]
            while len(self._until) >= _SKIPS_KEPT:
                del self._until[next(iter(self._until))]
        self._until.pop(key, None)  # re-added: the newest
        self._until[key] = now + for_s

    def holds(self, key: _K, now: float) -> bool:
        return self._until.get(key, -math.inf) > now


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
        staging_bytes: int = _STAGING_BYTES,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.staging = Staging()
        self.staging_bytes = staging_bytes
        self._now = now
        # hybrid read-throughs that brought nothing, as (first block, end), and the first blocks
        # of fetches that failed: each until when it is not asked for again
        self._fruitless: _Skips[tuple[bytes, int]] = _Skips()
        self._failed: _Skips[bytes] = _Skips()
        # per failure logged: when it was last logged, and how many have not been since
        self._warned: dict[str, tuple[float, int]] = {}
        self.tier = tier
        self.benefit = FetchBenefit(prefill_tokens_per_s, now)
        self.max_fetch_blocks = max_fetch_blocks
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        # (the block's key in the tier, block, replace the tier's value, tries so far)
        self._queue: queue.Queue[tuple[str, bytes, bool, int] | _Stop]
        self._queue = queue.Queue(maxsize=pending)
        self._stopping = threading.Event()
        # buffers a call that timed out may still write into
        self._held: list[bytearray | memoryview] = []
        self._thread = threading.Thread(target=self._publish_loop, name="prefixd-tier", daemon=True)
        self._installer = ThreadPoolExecutor(1, thread_name_prefix="prefixd-install")
        # A purge holds `_installing` (installs wait) and withdraws the staged blocks as it
        # begins and ends (`staging.epoch` counts that): blocks fetched before its end are neither
        # staged nor installed after it. Its removal from the tier holds `_publishing` (a put
        # under way ends first); the key prefixes it could not remove are kept out of
        # read-throughs until a later try removes them.
        self._installing = threading.Lock()
        self._publishing = threading.Lock()
        self._unremoved: set[str] = set()
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="prefixd-fetch")

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop publishing (what is queued after `timeout_s` is dropped), then close."""
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

    def published(self, identity: Identity, hashes: Sequence[bytes]) -> None:
        """Queue blocks a put stored or hung new parts on (a full queue drops and counts), keyed
        by the identity they are stored under (a share group's, `Store.namespace`), as every
        node's read-through asks for them. A hybrid block replaces its published value: it may
        carry a new checkpoint."""
        stored_as = self.store.namespace(identity)
        hybrid = identity.state is not None
        for block in hashes:
            self._enqueue((block_key(stored_as, block), block, hybrid, 0))

    def _enqueue(self, item: tuple[str, bytes, bool, int]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._count("publish_dropped")

    def _publish_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP or self._stopping.is_set():
                if item is not _STOP:
                    self._count("publish_dropped", 1 + self._queue.qsize())
                return
            key, block, replace, tries = item
            try:
                with self._publishing:
                    exported = self.store.export_block(block)
                    if exported is None:
                        continue  # evicted or removed since
                    self._offer(key, exported, replace)
            except PrefixdError as exc:
                self._warn("publish_errors", "publishing to the shared tier failed", exc)
                # a master restarting: unreachable, then no segment remounted yet for a second
                transient = isinstance(exc, TierUnavailableError | TierFullError)
                if transient and tries + 1 < _PUBLISH_TRIES:
                    self._enqueue((key, block, replace, tries + 1))
                self._stopping.wait(_BACKOFF_S)
            else:
                self._count("published_blocks")

    def _offer(self, key: str, exported: ExportedBlock, replace: bool) -> None:
        """Put a block's value, encoded straight into a buffer of the tier's (no copy of the payload
        between the store and the tier)."""
        parts = exported.parts
        room = self.tier.buffer(encoded_size(exported.record, exported.payload, parts))
        try:
            encode_block_into(room, exported.record, exported.payload, parts)
            self.tier.put(key, room, overwrite=replace)
        finally:
            self.tier.release(room)

    def read_through(
        self, identity: Identity, token_ids: PromptIds, local_blocks: int, *, staged: bool = False
    ) -> int:
        """Fetch, prove and install the blocks after the first `local_blocks` (for a hybrid
        identity, the local joint boundary); return how many were installed. `staged` (plain
        identities): return once they are proven, installs queued, with how many were staged;
        `with_staged` and `load` serve them meanwhile. Blocks are asked for, proven and staged
        under the identity they are stored under (`chain.identity`, a share group's), installed
        under `identity`."""
        chain = BlockChain(self.store.namespace(identity), token_ids)
        hybrid = identity.state is not None
        staged = staged and not hybrid
        if staged:
            local_blocks += len(self.staging.sizes_from(chain, local_blocks, chain.n_blocks))
        end = min(chain.n_blocks, local_blocks + self.max_fetch_blocks)
        if end <= local_blocks:
            return 0
        stats = self.store.stats()  # the local bytes per block: the mean of what it holds
        per_block = stats.payload_bytes / stats.blocks if stats.blocks else 0.0
        probe = False
        if not self.benefit.worth_it(identity.block_tokens, end - local_blocks, per_block):
            if not self.benefit.probe_due():
                self._count("remote_skipped_by_benefit")
                return 0
            probe = True  # the model may be stale: one fetch tells
            self._count("remote_benefit_probes")
        # before the check below: a purge that ends after it (its removal failed or not) is
        # one this read-through's fetch began before
        epoch = self.staging.epoch
        if self._unremoved and not self._purged_away(chain.identity):
            self._count("remote_skipped_unpurged")
            return 0
        asked = (chain.hash(local_blocks), end)
        now = self._now()
        with self._lock:
            fruitless = hybrid and self._fruitless.holds(asked, now)
            failed = self._failed.holds(asked[0], now)
        if fruitless or failed:
            self._count("remote_skipped_recently" if fruitless else "remote_skipped_after_failure")
            return 0
        started = time.perf_counter()
        try:
            installed = self._read_through(identity, chain, local_blocks, end, staged, epoch)
        except Exception as exc:  # noqa: BLE001 - memory the tier's client could not have, say
            # the local store still answers: a failure here is a counted, logged miss
            self._warn("read_through_errors", "reading through the shared tier failed", exc)
            installed = None
        took = time.perf_counter() - started
        self._count("remote_read_us", _us(took))
        if probe and installed:
            self.benefit.probed(took, identity.block_tokens, end - local_blocks)
        self._count("remote_hit_blocks", installed or 0)
        if hybrid and installed is not None and not installed:
            # the tier had the blocks and nothing new: they may all be stored, waiting for a
            # checkpoint the tier lacks too, and every lookup would fetch them again
            with self._lock:
                self._fruitless.add(asked, self._now(), _RECHECK_S)
        return installed or 0

    def with_staged(
        self, identity: Identity, token_ids: PromptIds, match: PrefixMatch
    ) -> PrefixMatch:
        """A plain identity's local `match` extended by the blocks staged after it."""
        if identity.state is not None or not len(self.staging):
            return match
        chain = BlockChain(self.store.namespace(identity), token_ids)
        sizes = self.staging.sizes_from(chain, match.n_blocks, chain.n_blocks)
        if not sizes:
            return match
        hashes = chain.hashes_until(match.n_blocks + len(sizes))
        return replace(
            match,
            hashes=match.hashes + tuple(hashes[match.n_blocks : match.n_blocks + len(sizes)]),
            payload_sizes=match.payload_sizes + tuple(sizes),
        )

    def load(
        self, identity: Identity, token_ids: PromptIds, out: Any, **options: Any
    ) -> LoadResult:
        """`Store.load`, continued from the staged blocks (`staging.staged_load`)."""
        return staged_load(self.store, self.staging, identity, token_ids, out, **options)

    def settle(self, timeout_s: float = _SETTLE_S) -> None:
        """Wait for the installs queued so far: a delete or purge after this removes what they
        install (one before them would see it come back)."""
        try:
            self._installer.submit(lambda: None).result(timeout_s)
        except RuntimeError:  # stopped: `stop` waited for the installs
            return
        except TimeoutError:
            self._count("settle_timeouts")
            log.warning("installs from the shared tier still running after %.0f s", timeout_s)

    def _read_through(
        self,
        identity: Identity,
        chain: BlockChain,
        local_blocks: int,
        end: int,
        staged: bool,
        epoch: int,
    ) -> int | None:
        """None when the tier lacks the first block asked for (or cannot be reached). `epoch`: the
        staging's before the read-through checked for unremoved purges."""
        align = runs.page_span(identity)
        # sized by a block that ends every group's page (the largest: pages hang there), else by
        # the first
        sized = -(-(local_blocks + 1) // align) * align - 1
        capacity = None
        for index in dict.fromkeys((sized if sized < end else local_blocks, local_blocks)):
            capacity = self._capacity(block_key(chain.identity, chain.hash(index)))
            if capacity != 0:
                break
        if not capacity:
            if capacity == 0:
                self._count("remote_misses")
            return None
        per_batch = max(1, min(_MAX_BATCH, _BATCH_BYTES // capacity))
        batches = runs.batches(local_blocks, end, per_batch, align)
        room_bytes = max(stop - start for start, stop in batches) * capacity
        # One buffer being fetched into, one proven, one installed; and when staged, those whose
        # blocks wait for their install, up to `staging_bytes` of them.
        extra = self.staging_bytes // room_bytes if staged else 0
        rooms = FetchRooms(self.tier, room_bytes, 3 + extra)
        broken = threading.Event()  # an install fell short: those after it are skipped
        installs: list[Future[tuple[int, int]]] = []
        brought = 0

        def fetch(start: int, stop: int) -> tuple[Future[Fetched], memoryview]:
            room = rooms.take()
            args = (chain, start, stop, capacity, room)
            return self._fetcher.submit(self._fetch, *args), room

        ahead: tuple[Future[Fetched], memoryview] | None = fetch(*batches[0])
        try:
            for index, (start, stop) in enumerate(batches):
                assert ahead is not None
                values, room = ahead[0].result()
                ahead = None
                if not values:  # the tier failed: it may still write into the room
                    rooms.forget()
                    break
                whole = len(values) == stop - start and None not in values
                if whole and index + 1 < len(batches) and not broken.is_set():
                    ahead = fetch(*batches[index + 1])  # the next round trip, while this is proven
                batch = self._proven(identity, chain, start, values)
                if not batch or broken.is_set():
                    rooms.back(room)
                    break
                n = len(batch)
                on_end: Callable[[], None] = partial(rooms.back, room)
                if staged:
                    hashes = [chain.hash(i) for i in range(start, start + n)]
                    run = self.staging.stage(hashes, [b.payload for b in batch], on_end, epoch)
                    if run is None:  # a purge ended since the fetch began
                        rooms.back(room)
                        break
                    on_end = partial(self.staging.end, run)
                    brought += n
                    self._count("remote_staged_blocks", n)
                installs.append(
                    self._installer.submit(
                        self._install_in_turn, identity, chain, start, batch, broken, on_end, epoch
                    )
                )
                if n < stop - start:
                    break
        finally:
            if ahead is not None:  # a batch fetched ahead and not needed: no call outlives this
                if ahead[0].cancel() or ahead[0].result()[0]:
                    rooms.back(ahead[1])
                else:  # the tier failed: it may still write into the room
                    rooms.forget()
            if not staged:
                brought = sum(done.result()[1] for done in installs)
            rooms.close()
        return brought

    def _install_in_turn(
        self,
        identity: Identity,
        chain: BlockChain,
        first: int,
        batch: list[RemoteBlock],
        broken: threading.Event,
        on_end: Callable[[], None],
        epoch: int,
    ) -> tuple[int, int]:
        """`_install` in the order the batches were proven, unless one before fell short or a
        purge came after their fetch (`epoch`: the staging's before it); `on_end` runs either
        way."""
        try:
            with self._installing:
                if broken.is_set() or epoch != self.staging.epoch:
                    return 0, 0
                expected = len(batch)
                done, new = self._install(identity, chain, first, batch)
            if done < expected:
                broken.set()
            self._count("remote_installed_blocks", new)
            return done, new
        finally:
            on_end()

    def _capacity(self, key: str) -> int | None:
        """Room for one value of a batch: this one's size with some slack (one identity's values are
        about the same size; a longer one is fetched alone, `_fetch` bounds their bytes); 0 when
        missing, None when the tier fails."""
        try:
            size = _within_limit(self.tier.size(key))
        except PrefixdError as exc:
            self._warn("fetch_errors", "fetching from the shared tier failed", exc)
            return None
        return 0 if size is None else size + size // 16 + 64

    def _fetch(
        self,
        chain: BlockChain,
        start: int,
        stop: int,
        capacity: int,
        buffer: memoryview,
    ) -> Fetched:
        """Blocks [start, stop) in one round trip into `buffer`, up to the first missing one (None)
        or the first that would take the values fetched alone past `_BATCH_BYTES` (the first such
        value is fetched whatever its size); [] when the tier fails."""
        keys = [block_key(chain.identity, chain.hash(i)) for i in range(start, stop)]
        started = time.perf_counter()
        try:
            lengths = self.tier.get_many_into(keys, buffer, capacity)
            view = memoryview(buffer)
            values: list[memoryview | None] = []
            alone = 0  # bytes of the values fetched alone, each held until the batch is proven
            for i, n in enumerate(lengths):
                if n is None:
                    value = None
                elif n < 0:  # longer than the room for it: alone, if the batch has room left
                    size = _within_limit(self.tier.size(keys[i]))
                    if size is not None and alone and alone + size > _BATCH_BYTES:
                        break  # the batch ends here: a later read-through goes on
                    alone += size or 0
                    value = None if size is None else self._get(keys[i], size)
                else:
                    value = view[i * capacity : i * capacity + n]
                values.append(value)
                if value is None:
                    self._count("remote_misses")
                    break
        except PrefixdError as exc:
            with self._lock:
                self._held.append(buffer)  # a call that timed out may still write into it
                if isinstance(exc, TierTransferError):
                    self._failed.add(chain.hash(start), self._now(), _REFETCH_S)
            self._warn("fetch_errors", "fetching from the shared tier failed", exc)
            return [], buffer
        finally:
            self._release_held()
        got = sum(v.nbytes for v in values if v is not None)
        took = time.perf_counter() - started
        self.benefit.fetch_time.observe(got, took)
        self._count("remote_fetch_us", _us(took))
        return values, buffer

    def _proven(
        self, identity: Identity, chain: BlockChain, start: int, values: list[memoryview | None]
    ) -> list[RemoteBlock]:
        """`values` proven to be these blocks, up to the first that is absent, fails, or was
        created before the tenant's time to live (a value outlives the entry it was published
        from: the tier keeps it, and an install would store it as new)."""
        started = time.perf_counter()
        proven: list[RemoteBlock] = []
        expired_before = self.store.min_created_ns(identity)
        for index, value in enumerate(values, start):
            if value is None:
                break
            try:
                block = decode_block(
                    value,
                    identity_digest=chain.identity.digest,
                    parent=chain.parent_of(index),
                    tokens=bytes(chain.block_bytes(index)),
                    spec=identity.state,
                    block_index=index,
                    block_tokens=identity.block_tokens,
                )
            except RemoteBlockError as exc:
                self._warn(
                    "remote_verify_failures",
                    "a block from the shared tier failed verification",
                    exc,
                )
                with self._lock:  # it would fail again: not fetched at every lookup
                    self._failed.add(chain.hash(index), self._now(), _REFETCH_S)
                break
            if block.created_ns < expired_before:
                self._count("remote_expired_blocks")
                with self._lock:  # expired for good: not fetched at every lookup
                    self._failed.add(chain.hash(index), self._now(), _REFETCH_S)
                break
            proven.append(block)
        self._count("remote_prove_us", _us(time.perf_counter() - started))
        return proven

    def _get(self, key: str, size: int) -> memoryview | None:
        """The value under `key`, of `size` bytes, fetched into a buffer of its own (the tier's
        plain get copies through a staging buffer). A buffer whose fetch failed is held until the
        tier lets go of it: a call that timed out may still write into it."""
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
                for held in self._held:
                    if isinstance(held, memoryview):
                        self.tier.release(held)
                self._held.clear()

    def _install(
        self, identity: Identity, chain: BlockChain, first: int, batch: list[RemoteBlock]
    ) -> tuple[int, int]:
        """Put proven blocks in the local store in one transaction; empties `batch` on success.
        Returns how many were put (for a hybrid identity, up to the last boundary the run closes)
        and how many of those are new: blocks after the joint boundary may be stored already."""
        spec = identity.state
        words = chain.token_bytes  # the wire form: packed ids, or with the content's digests
        started = time.perf_counter()
        try:
            if spec is None:
                n = len(batch)
                payloads = [block.payload for block in batch]
                born = min(block.created_ns for block in batch)  # its TTL counts from there
                result = self.store.put(
                    identity, words, payloads, first_block=first, created_ns=born
                )
                size = sum(p.nbytes for p in payloads)
            else:
                n = runs.closed_run(spec, identity.block_tokens, first, batch)
                if not n:
                    return 0, 0
                paged, checkpoints = runs.state_of(spec, identity.block_tokens, first, batch[:n])
                result = self.store.put_state(
                    identity,
                    words,
                    paged=paged,
                    checkpoints=checkpoints,
                    created_ns=min(block.created_ns for block in batch[:n]),
                    upto_tokens=(first + n) * identity.block_tokens,
                    first_block=first,
                )
                size = sum(p.nbytes for block in batch[:n] for p in block.parts.values())
        except PrefixdError as exc:
            self._warn("install_errors", "installing blocks from the shared tier failed", exc)
            return 0, 0
        finally:
            self._count("remote_install_us", _us(time.perf_counter() - started))
        new = n if result.stored or result.parts else 0
        self._count("remote_bytes", size if new else 0)
        batch.clear()
        return n, new

    def purge(self, purge: Callable[[], PurgeReport], tenant: str | None = None) -> PurgeReport:
        """Run `purge` (of the local store), then remove the tier's objects of the identities it
        removed whole, or of every identity of `tenant` (any node's). Installs wait meanwhile, and
        no block fetched or staged before its end is installed or served after it. A prefix the
        tier fails to remove is tried again before any read-through it covers, a miss until then."""
        with self._installing:
            self.staging.withdraw()
            try:
                report = purge()
                prefixes = [tenant_prefix(tenant)] if tenant is not None else []
                prefixes += [identity_prefix(i) for i in report.removed if i.tenant != tenant]
                if prefixes:
                    with self._publishing:
                        with self._lock:
                            self._unremoved.update(prefixes)
                        self._remove_unremoved()
            finally:
                self.staging.withdraw()
        return report

    def _purged_away(self, identity: Identity) -> bool:
        """Whether no purge's objects of `identity` wait in the tier (a removal tried again)."""
        with self._lock:
            waiting = {tenant_prefix(identity.tenant), identity_prefix(identity)} & self._unremoved
        if not waiting:
            return True
        with self._publishing:
            self._remove_unremoved()
        with self._lock:
            return not waiting & self._unremoved

    def _remove_unremoved(self) -> int:
        """(under `_publishing`) Remove what purges left in the tier; the number removed."""
        with self._lock:
            prefixes = sorted(self._unremoved)
        removed = 0
        for prefix in prefixes:
            try:
                removed += self.tier.remove_prefix(prefix)
            except PrefixdError as exc:
                self._warn(
                    "purge_errors", "removing purged objects from the shared tier failed", exc
                )
            else:
                with self._lock:
                    self._unremoved.discard(prefix)
        self._count("remote_purged_objects", removed)
        return removed

    def _warn(self, counter: str, failure: str, exc: Exception) -> None:
        """Count a failure under `counter`, and log it: the first of its kind, then one line each
        `_WARN_EVERY_S` at most, with how many were not logged. A master away fails every lookup
        that misses locally, and journald drops the lines of a service that floods it; the counts
        hold every failure."""
        now = self._now()
        with self._lock:
            self.counts[counter] += 1
            last, quiet = self._warned.get(failure, (-math.inf, 0))
            if now - last < _WARN_EVERY_S:
                self._warned[failure] = (last, quiet + 1)
                return
            self._warned[failure] = (now, 0)
        more = f" ({quiet} more since the last such line)" if quiet else ""
        log.warning("%s: %s%s", failure, exc, more)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self.counts)
        counts["publish_queued"] = self._queue.qsize()
        counts["remote_staged_served_blocks"] = self.staging.served_blocks
        return counts


def _within_limit(size: int | None) -> int | None:
    """A value's size as the tier reports it, refused past MAX_VALUE_BYTES."""
    if size is not None and size > MAX_VALUE_BYTES:
        raise RemoteBlockError(f"a value of {size} bytes, more than any block ({MAX_VALUE_BYTES})")
    return size


def _us(seconds: float) -> int:
    return round(seconds * 1e6)
