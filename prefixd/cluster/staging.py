"""Proven remote blocks between their fetch and their install, and the buffers they lie in.

A read-through of a plain identity does not wait for the local store's install: once a batch is
proven (prefixd.cluster.blocks: identity, parent, token ids and the payload's origin checksum),
its blocks are *staged*, and lookups and loads are answered from the fetch buffer while the
install runs behind them. Writing into pages the store never had is what bounds a first fill on
a VM whose host takes freed memory back; this takes it off the hit's path. A staged block leaves
the staging when its install ends: installed, the local store answers for it; failed, it (and
every block after it, whose install is skipped) is no longer offered, a shorter hit as after an
eviction. A buffer goes back to the read-through's pool only when no load copies from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

from prefixd.schema.chain import BlockChain
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import TokenIds
from prefixd.store import Store
from prefixd.store.read import dest_view
from prefixd.store.results import LoadResult


class TierBuffers(Protocol):
    """The fetch buffers a shared tier lends (the bridge's TierClient has them)."""

    def buffer(self, size: int) -> memoryview: ...

    def release(self, view: memoryview) -> None: ...


@dataclass(eq=False)
class StagedRun:
    """One proven batch: its blocks' chain hashes and payloads (views into one fetch buffer)."""

    hashes: list[bytes]
    payloads: list[memoryview]
    on_free: Callable[[], None]  # gives the buffer back, once the run ended and nobody reads it
    readers: int = 0
    ended: bool = False


@dataclass
class Copied:
    """Staged payloads a load copied, back to back from the start of its buffer; `next_size`
    is the size of the next staged block when the buffer had no room for it (else 0)."""

    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    next_size: int = 0


class Staging:
    """The staged blocks of every read-through in flight, by chain hash (which names the identity
    too); thread-safe: read-throughs stage, the installer ends runs, loads copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[bytes, tuple[StagedRun, int]] = {}
        self.served_blocks = 0  # copied into loads, all told

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def stage(
        self, hashes: list[bytes], payloads: list[memoryview], on_free: Callable[[], None]
    ) -> StagedRun:
        """Offer a proven batch until `end` is called for it (a block staged already by another
        read-through of the same prompt keeps its first run)."""
        run = StagedRun(hashes, payloads, on_free)
        with self._lock:
            for index, block in enumerate(hashes):
                self._blocks.setdefault(block, (run, index))
        return run

    def end(self, run: StagedRun) -> None:
        """The run's install ended (either way): no longer offered, and its buffer given back as
        soon as no load copies from it."""
        with self._lock:
            for block in run.hashes:
                if self._blocks.get(block, (None, 0))[0] is run:
                    del self._blocks[block]
            run.ended = True
            free = run.readers == 0
        if free:
            self._free(run)

    def sizes_from(self, chain: BlockChain, first: int, limit: int) -> list[int]:
        """The payload sizes of the staged blocks from block `first` on, up to the first block
        (or `limit`) that is not staged."""
        with self._lock:
            return [run.payloads[at].nbytes for run, at in self._run_from(chain, first, limit)]

    def _run_from(self, chain: BlockChain, first: int, limit: int) -> list[tuple[StagedRun, int]]:
        """The staged blocks from block `first` on, in order, up to the first one that is not
        (or `limit`); called under the lock."""
        found: list[tuple[StagedRun, int]] = []
        if self._blocks:
            for index in range(first, limit):
                entry = self._blocks.get(chain.hash(index))
                if entry is None:
                    break
                found.append(entry)
        return found

    def copy_into(self, chain: BlockChain, first: int, limit: int, out: memoryview) -> Copied:
        """Copy the staged payloads of blocks `first`... (before `limit`) back to back into
        `out`, as many as fit; the runs read from are held meanwhile (not under the lock)."""
        taken: list[tuple[StagedRun, int]] = []
        copied = Copied()
        with self._lock:
            room = out.nbytes
            for run, at in self._run_from(chain, first, limit):
                size = run.payloads[at].nbytes
                if size > room:
                    copied.next_size = size
                    break
                room -= size
                taken.append((run, at))
            held = list(dict.fromkeys(run for run, _ in taken))
            for run in held:
                run.readers += 1
            self.served_blocks += len(taken)
        try:
            offset = 0
            for run, at in taken:
                payload = run.payloads[at]
                out[offset : offset + payload.nbytes] = payload
                copied.offsets.append(offset)
                copied.sizes.append(payload.nbytes)
                offset += payload.nbytes
        finally:
            self._let_go(held)
        return copied

    def _let_go(self, runs: Iterable[StagedRun]) -> None:
        freed = []
        with self._lock:
            for run in runs:
                run.readers -= 1
                if run.ended and run.readers == 0:
                    freed.append(run)
        for run in freed:
            self._free(run)

    @staticmethod
    def _free(run: StagedRun) -> None:
        run.payloads = []
        run.on_free()


class FetchRooms:
    """The fetch buffers of one read-through, of one size, from the tier (which may write into
    them without a copy: prefixd.cluster.child): at most `most` at once; `take` waits for one to
    come back when all are out. What comes back after `close` is given back to the tier."""

    def __init__(self, tier: TierBuffers, size: int, most: int) -> None:
        self._tier = tier
        self._size = size
        self._most = max(1, most)
        self._cond = threading.Condition()
        self._free: list[memoryview] = []
        self._out = 0  # taken and not back (nor forgotten)
        self._closed = False

    def take(self) -> memoryview:
        with self._cond:
            while not self._free and self._out >= self._most:
                self._cond.wait()
            self._out += 1
            if self._free:
                return self._free.pop()
        return self._tier.buffer(self._size)

    def back(self, room: memoryview) -> None:
        """A room nothing reads from nor writes into any more."""
        with self._cond:
            self._out -= 1
            self._cond.notify()
            if not self._closed:
                self._free.append(room)
                return
        self._tier.release(room)

    def forget(self) -> None:
        """A room a failed fetch may still write into: the bridge holds it until the tier lets
        go of it (`SharedTierBridge._held`); it no longer counts here."""
        with self._cond:
            self._out -= 1
            self._cond.notify()

    def close(self) -> None:
        """The read-through is over: give back the free rooms now, the others when they come
        back."""
        with self._cond:
            self._closed = True
            free, self._free = self._free, []
        for room in free:
            self._tier.release(room)


def staged_load(
    store: Store,
    staging: Staging,
    identity: Identity,
    token_ids: TokenIds,
    out: Any,
    *,
    max_blocks: int | None = None,
    hashes: bytes | None = None,
    first_block: int = 0,
    deadline: float | None = None,
) -> LoadResult:
    """`Store.load`, continued from the staged blocks that follow what the store has, and from
    the store again where a staged run's install ended meanwhile (it left the staging after its
    commit, so the store has it); back to back in `out` as the store lays them. A staged copy is
    a copy in memory of bytes proven already: the deadline bounds the store's reads alone."""
    staged = len(staging)  # before the store is asked: an install may end while it is
    read = partial(store.load, identity, token_ids, hashes=hashes, deadline=deadline)
    result = read(out, max_blocks=max_blocks, first_block=first_block)
    if identity.state is not None or result.next_size or not staged:
        return result
    chain = BlockChain(identity, token_ids)
    limit = chain.n_blocks if max_blocks is None else min(chain.n_blocks, first_block + max_blocks)
    at = first_block + result.n_blocks
    offsets, sizes = list(result.offsets), list(result.sizes)
    used = offsets[-1] + sizes[-1] if sizes else 0
    buffer = dest_view(out, 0, None)
    next_size = 0
    while at < limit and not next_size:
        copied = staging.copy_into(chain, at, limit, buffer[used:])
        more: Sequence[tuple[int, int]] = list(zip(copied.offsets, copied.sizes, strict=True))
        next_size = copied.next_size
        if not more and not next_size:
            # not staged: its install may have ended since the store was asked
            again = read(buffer[used:], max_blocks=limit - at, first_block=at)
            more = list(zip(again.offsets, again.sizes, strict=True))
            next_size = again.next_size
            if not more:
                break
        offsets.extend(used + offset for offset, _ in more)
        sizes.extend(size for _, size in more)
        used = offsets[-1] + sizes[-1] if sizes else 0
        at += len(more)
    if at == first_block + result.n_blocks:
        return result if not next_size else replace(result, next_size=next_size)
    block_tokens = identity.block_tokens
    return LoadResult(
        at - first_block, at * block_tokens, tuple(offsets), tuple(sizes), first_block, next_size
    )
