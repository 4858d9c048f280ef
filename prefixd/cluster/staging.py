"""Proven remote blocks between their fetch and their install, and the buffers they lie in.

A plain identity's read-through does not wait for the install: proven blocks are staged, and lookups
and loads are served from the fetch buffer meanwhile (writing pages the store never had is what
bounds a first fill on a VM whose host takes freed memory back). A staged block leaves when its
install ends: installed, the store answers for it; failed, it (and every block after it) is no
longer offered. A buffer goes back to the pool only when no load copies from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

from prefixd.schema.chain import BlockChain
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import PromptIds
from prefixd.store import Store
from prefixd.store.read import dest_view
from prefixd.store.results import LoadResult


class TierBuffers(Protocol):
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
    """Staged payloads a load copied back to back; `next_size`: the next staged block's size when
    the buffer had no room for it (else 0)."""

    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    next_size: int = 0


class Staging:
    """The staged blocks of every read-through in flight, by chain hash; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._blocks: dict[bytes, tuple[StagedRun, int]] = {}
        self.served_blocks = 0  # copied into loads, all told
        # withdrawals so far: a read-through takes it before it fetches, and what it fetched is
        # not staged (nor installed, prefixd.cluster.bridge) after a withdrawal that came since
        self.epoch = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def stage(
        self,
        hashes: list[bytes],
        payloads: list[memoryview],
        on_free: Callable[[], None],
        epoch: int,
    ) -> StagedRun | None:
        """Offer a proven batch until `end` (a block another read-through staged already keeps its
        first run); None, offering nothing, when a withdrawal came after `epoch` (its fetch
        began before a purge's end)."""
        run = StagedRun(hashes, payloads, on_free)
        with self._lock:
            if epoch != self.epoch:
                return None
            for index, block in enumerate(hashes):
                self._blocks.setdefault(block, (run, index))
        return run

    def end(self, run: StagedRun) -> None:
        """The run's install ended: no longer offered, its buffer given back once no load copies
        from it."""
        with self._lock:
            for block in run.hashes:
                if self._blocks.get(block, (None, 0))[0] is run:
                    del self._blocks[block]
            run.ended = True
            free = run.readers == 0
        if free:
            self._free(run)

    def withdraw(self) -> None:
        """Offer no staged block any more, nor stage one fetched before (a purge came): each
        run's buffer still goes back at its end."""
        with self._lock:
            self._blocks.clear()
            self.epoch += 1

    def sizes_from(self, chain: BlockChain, first: int, limit: int) -> list[int]:
        """The payload sizes of the staged blocks from block `first` on, up to the first one (or
        `limit`) not staged."""
        with self._lock:
            return [run.payloads[at].nbytes for run, at in self._run_from(chain, first, limit)]

    def _run_from(self, chain: BlockChain, first: int, limit: int) -> list[tuple[StagedRun, int]]:
        """(called under the lock)"""
        found: list[tuple[StagedRun, int]] = []
        if self._blocks:
            for index in range(first, limit):
                entry = self._blocks.get(chain.hash(index))
                if entry is None:
                    break
                found.append(entry)
        return found

    def copy_into(self, chain: BlockChain, first: int, limit: int, out: memoryview) -> Copied:
        """Copy the staged payloads from block `first` back to back into `out`, as many as fit; the
        runs are held meanwhile (not under the lock)."""
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
    """One read-through's fetch buffers from the tier, at most `most` out at once (`take` waits);
    what comes back after `close` goes back to the tier."""

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
        with self._cond:
            self._out -= 1
            self._cond.notify()
            if not self._closed:
                self._free.append(room)
                return
        self._tier.release(room)

    def forget(self) -> None:
        """A room a failed fetch may still write into: the bridge holds it until the tier lets go
        (`SharedTierBridge._held`)."""
        with self._cond:
            self._out -= 1
            self._cond.notify()

    def close(self) -> None:
        """Give back the free rooms now, the others when they come back."""
        with self._cond:
            self._closed = True
            free, self._free = self._free, []
        for room in free:
            self._tier.release(room)


def staged_load(
    store: Store,
    staging: Staging,
    identity: Identity,
    token_ids: PromptIds,
    out: Any,
    *,
    max_blocks: int | None = None,
    hashes: bytes | None = None,
    first_block: int = 0,
    deadline: float | None = None,
) -> LoadResult:
    """`Store.load`, continued from the staged blocks after what the store has, and from the store
    again where a staged run's install ended meanwhile. The deadline bounds the store's reads alone
    (a staged copy is a memory copy of bytes proven already)."""
    staged = len(staging)  # before the store is asked: an install may end while it is
    read = partial(store.load, identity, token_ids, hashes=hashes, deadline=deadline)
    result = read(out, max_blocks=max_blocks, first_block=first_block)
    if identity.state is not None or result.next_size or not staged:
        return result
    chain = BlockChain(store.namespace(identity), token_ids)  # as the read-through staged it
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
