"""Who owns which bytes of a client's shared region: an allocator of leased spans.

The daemon only reads or writes spans the client leased for that request, and a span is free
again only when all of its holders are gone: its `Lease` (released or collected), every buffer
made from it (a memoryview, array or tensor keeps its ctypes buffer alive), and every request
that names it (a cancelled task's request still owns its spans until the reply). A request lost
with its connection may still be running in the daemon, so its spans stay quarantined until a
reconnect finds another daemon instance. So two live uses never overlap, and a released view
raises instead of showing someone else's bytes. Shared by threads and tasks under one lock;
waiters are served FIFO, so a large request is not starved by small ones.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import ctypes
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, Self

import numpy as np

from prefixd.errors import RegionError, RegionFullError
from prefixd.wire.region import SharedRegion

ALIGN = 64  # every span starts on a cache line


class Event(Protocol):
    """What `release_after` waits on: a CUDA event (or anything with `query`)."""

    def query(self) -> bool: ...


class Span:
    """One allocated extent and what still holds it (see the module docstring)."""

    __slots__ = ("holders", "inflight", "lost", "offset", "owner", "size")

    def __init__(self, owner: RegionAllocator, offset: int, size: int) -> None:
        self.owner = owner
        self.offset = offset
        self.size = size
        self.holders = 1  # the lease handle
        self.inflight = 0  # requests naming it whose replies have not arrived
        self.lost = False  # named by a request lost with its connection

    @property
    def span(self) -> Span:
        return self

    def write(self, data: np.ndarray, at: int = 0) -> None:
        """Copy `data` (a contiguous array) into the span from `at` (see Lease.write)."""
        n = data.nbytes
        if not 0 <= at <= at + n <= self.size or self.holders <= 0:
            raise RegionError(f"{n} bytes at {at} do not fit a held span of {self.size}")
        start = self.offset + at
        # a memoryview copy is one memcpy, a little quicker than numpy's assignment
        self.owner.region.view[start : start + n] = data.reshape(-1).data.cast("B")

    def release(self) -> None:
        """Let go of a span taken with `RegionAllocator.try_span` (no lease around it)."""
        if self.holders > 0:
            self.owner.drop(self)

    def begin_request(self) -> None:
        """A request naming this span is about to be sent."""
        self.owner.begin_request(self)

    def end_request(self, *, lost: bool) -> None:
        """That request's reply arrived, or (`lost`) its connection broke first."""
        self.owner.end_request(self, lost=lost)


class Lease:
    """`size` bytes of the region from `offset`, owned by one operation or caller; `release()`
    makes every view it handed out raise (the space is reused once nothing refers to it)."""

    __slots__ = ("_buffer", "_released", "_span", "_views", "allocator", "offset", "size")

    def __init__(self, allocator: RegionAllocator, span: Span, size: int) -> None:
        self.allocator = allocator
        self.offset = span.offset
        self.size = size
        self._span = span
        self._buffer: ctypes.Array[ctypes.c_ubyte] | None = None
        self._views: list[memoryview] = []
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    @property
    def view(self) -> memoryview:
        """The whole span, writable."""
        return self.slice(0, self.size)

    def slice(self, start: int, stop: int) -> memoryview:
        """Bytes [start, stop) of the span (offsets within the lease), invalidated by release."""
        if self._released:
            raise RegionError("this lease was released: its bytes may belong to another request")
        if not 0 <= start <= stop <= self.size:
            raise RegionError(f"[{start}, {stop}) is outside a lease of {self.size} bytes")
        if self._buffer is None:
            self._buffer = self.allocator.buffer(self._span, self.size)
        view = memoryview(self._buffer).cast("B")[start:stop]
        self._views.append(view)
        return view

    def write(self, data: np.ndarray, at: int = 0) -> None:
        """Copy `data` (a contiguous array) into the span from `at` through the region's own
        mapping: no view is made that could outlive the lease."""
        if self._released or not 0 <= at <= at + data.nbytes <= self.size:
            raise RegionError(f"{data.nbytes} bytes at {at} do not fit a held lease of {self.size}")
        self._span.write(data, at)

    def trim(self, used: int) -> None:
        """Keep only the first `used` bytes (at least one byte is kept while the lease lives);
        the rest is free again at once. Only before any view was taken."""
        if self._buffer is not None or self._released:
            raise RegionError("a lease can only be trimmed before its bytes are viewed")
        self.size = min(self.size, max(used, 0))
        self.allocator.shrink(self._span, max(self.size, 1))

    def loaded(self, offsets: Sequence[int], sizes: Sequence[int]) -> tuple[memoryview, ...]:
        """Views of the payloads a load wrote at region `offsets`, the lease first trimmed to
        the end of the last (the rest is free again at once)."""
        starts = [offset - self.offset for offset in offsets]
        self.trim(max((at + size for at, size in zip(starts, sizes)), default=0))
        return tuple(self.slice(at, at + size) for at, size in zip(starts, sizes))

    def release(self) -> None:
        """Give the span back: its views raise from now on (one that something else still
        exports stays readable and keeps the span out of use). Harmless twice."""
        if self._released:
            return
        self._released = True
        for view in self._views:
            with contextlib.suppress(BufferError):  # exported elsewhere: that keeps the span alive
                view.release()
        self._views.clear()
        self._buffer = None  # the span's buffer dies with its last export
        self.allocator.drop(self._span)

    def release_after(self, event: Event | None) -> None:
        """Release once `event` (an asynchronous copy of the span) has completed."""
        if event is None or event.query():
            self.release()
        else:
            self.allocator.defer(self, event)

    @property
    def span(self) -> Span:
        """What a request naming these bytes holds while it is in flight."""
        return self._span

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __del__(self) -> None:
        """Collected without release: the views stay valid (`client.load(...).views` may
        outlive its result); their buffer holds the span until the last of them is gone."""
        if getattr(self, "_released", True):
            return
        self._released = True
        self._views.clear()
        self._buffer = None
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to give back to
            self.allocator.drop(self._span)

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"Lease(offset={self.offset}, size={self.size}, {state})"


@dataclass(frozen=True, slots=True)
class RegionUsage:
    """What the region's space is doing now."""

    size: int
    free_bytes: int
    leased_bytes: int
    leases: int
    quarantined_bytes: int
    waiters: int


@dataclass(slots=True, eq=False)
class _Waiter:
    """One operation waiting for space: `nbytes` exactly, or (largest) any span of at least
    `nbytes`. `lease` is set under the allocator's lock when it is served."""

    nbytes: int
    largest: bool
    wake: Callable[[], None]
    lease: Lease | None = None
    error: BaseException | None = None  # set instead when the wait is interrupted


class RegionAllocator:
    """Leases spans of one shared region (first fit, spans aligned to ALIGN bytes)."""

    def __init__(self, region: SharedRegion, *, name: str = "region") -> None:
        self.region = region
        self.size = region.size
        self.name = name
        self._lock = threading.RLock()  # RLock: a buffer may die (and free) while it is held
        self._free: list[list[int]] = [[0, region.size]]  # [offset, size], sorted, coalesced
        self._spans: dict[int, Span] = {}  # live spans by offset
        self._waiters: deque[_Waiter] = deque()
        self._deferred: list[tuple[Lease, Event]] = []
        self._lost: list[Span] = []

    # --- taking space ---------------------------------------------------------------------------

    def try_acquire(self, nbytes: int, *, largest: bool = False) -> Lease | None:
        """A lease like `acquire`'s, or None when there is no room now or others wait ahead."""
        self.check_fits(nbytes)
        with self._lock:
            self._poll_deferred()
            if self._waiters:
                return None
            return self._take(nbytes, largest)

    def try_span(self, nbytes: int) -> Span | None:
        """A bare span of `nbytes` for the client's own short use (a request's token ids): no
        Lease around it, released with `Span.release()`; None when there is no room now."""
        with self._lock:
            if self._deferred:
                self._poll_deferred()
            if self._waiters or nbytes > self.size:
                return None
            if not self._spans:  # the usual case for token ids: the region is all free
                size = min(_aligned(nbytes), self.size)
                self._free = [[size, self.size - size]] if size < self.size else []
                span = self._spans[0] = Span(self, 0, size)
                return span
            return self._carve(nbytes, False)

    def acquire(self, nbytes: int, *, timeout: float, largest: bool = False) -> Lease:
        """A lease, waiting up to `timeout` seconds for space (threads)."""
        ready = threading.Event()
        waiter = self._enqueue(nbytes, largest, ready.set)
        if isinstance(waiter, Lease):
            return waiter
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                ready.wait(max(0.0, self._wait_slice(left)))
                lease = self._outcome(waiter, time.monotonic() >= deadline, timeout)
                if lease is not None:
                    return lease
        except BaseException:
            self._abandon(waiter)
            raise

    async def acquire_async(self, nbytes: int, *, timeout: float, largest: bool = False) -> Lease:
        """A lease, waiting up to `timeout` seconds for space (asyncio; never blocks the loop)."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(ready.set)

        waiter = self._enqueue(nbytes, largest, wake)
        if isinstance(waiter, Lease):
            return waiter
        deadline = loop.time() + timeout
        try:
            while True:
                left = max(0.0, deadline - loop.time())
                try:
                    await asyncio.wait_for(ready.wait(), self._wait_slice(left))
                except TimeoutError:
                    pass
                ready.clear()
                lease = self._outcome(waiter, loop.time() >= deadline, timeout)
                if lease is not None:
                    return lease
        except BaseException:  # timed out or cancelled: served meanwhile, or still queued
            self._abandon(waiter)
            raise

    def _enqueue(self, nbytes: int, largest: bool, wake: Callable[[], None]) -> Lease | _Waiter:
        """A lease at once when no one waits ahead and there is room, else a queued waiter."""
        with self._lock:
            lease = self.try_acquire(nbytes, largest=largest)
            if lease is not None:
                return lease
            waiter = _Waiter(nbytes, largest, wake)
            self._waiters.append(waiter)
            return waiter

    def _wait_slice(self, left: float) -> float:
        """Poll while copies that hold space may finish with no one to free it (release_after)."""
        return min(left, 0.005) if self._deferred else left

    def _outcome(self, waiter: _Waiter, expired: bool, timeout: float) -> Lease | None:
        """After a wake-up: the waiter's lease, its error, the timeout, or None to wait on."""
        with self._lock:
            self._poll_deferred()
            if waiter.lease is not None:
                return waiter.lease
            if waiter.error is not None:
                raise waiter.error
            if expired:
                raise self._full(waiter.nbytes, timeout)
            return None

    def _abandon(self, waiter: _Waiter) -> None:
        with self._lock:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                self._serve()  # the waiters behind it may fit now
            elif waiter.lease is not None:
                waiter.lease.release()

    def check_fits(self, nbytes: int) -> None:
        """Raise RegionFullError when `nbytes` could never be leased at once, however much is free."""
        if nbytes > self.size:
            raise RegionFullError(
                f"{nbytes} bytes are needed at once, the {self.name} holds {self.size}: "
                "use a larger region"
            )
        if nbytes < 0:
            raise RegionError(f"a lease of {nbytes} bytes")

    def _full(self, nbytes: int, waited: float) -> RegionFullError:
        usage = self.usage()
        return RegionFullError(
            f"the {self.name} of {self.size} bytes has no free span of {nbytes} bytes after "
            f"waiting {waited:g} s ({usage.leases} leases hold {usage.leased_bytes} bytes, "
            f"{usage.quarantined_bytes} bytes wait for lost requests): release loaded results "
            "sooner or use a larger region"
        )

    def _take(self, nbytes: int, largest: bool) -> Lease | None:
        """Under the lock: a lease carved out of the free list, or None."""
        span = self._carve(nbytes, largest)
        if span is None:
            return None
        return Lease(self, span, span.size if largest else nbytes)

    def _carve(self, nbytes: int, largest: bool) -> Span | None:
        """Under the lock: a span carved out of the free list (first fit, or the largest)."""
        want = _aligned(nbytes)
        best = -1
        for i, (start, free) in enumerate(self._free):
            if largest:
                if free >= nbytes and (best < 0 or free > self._free[best][1]):
                    best = i
            elif free >= want or (free >= nbytes and start + free == self.size):
                best = i
                break
        if best < 0:
            return None
        offset, free = self._free[best]
        size = free if largest else min(want, free)
        if size == free:
            del self._free[best]
        else:
            self._free[best] = [offset + size, free - size]
        span = Span(self, offset, size)
        self._spans[offset] = span
        return span

    # --- giving it back -------------------------------------------------------------------------

    def buffer(self, span: Span, size: int) -> ctypes.Array[ctypes.c_ubyte]:
        """A ctypes buffer over the span's bytes whose lifetime holds the span: every memoryview,
        numpy array or tensor made from it keeps it (and so the span) alive."""
        buffer = (ctypes.c_ubyte * size).from_buffer(self.region.mapping, span.offset)
        with self._lock:
            span.holders += 1
        weakref.finalize(buffer, self.drop, span)
        return buffer

    def shrink(self, span: Span, size: int) -> None:
        with self._lock:
            size = min(_aligned(size), span.size)
            if size < span.size:
                self._insert(span.offset + size, span.size - size)
                span.size = size
                self._serve()

    def drop(self, span: Span) -> None:
        """One holder of `span` let go; free it when it was the last."""
        with self._lock:
            span.holders -= 1
            self._maybe_free(span)

    def begin_request(self, span: Span) -> None:
        with self._lock:
            span.inflight += 1

    def lose(self, span: Span) -> None:
        """A request naming `span`, which its caller still holds, was lost with its connection:
        quarantine the span (a blocking caller's own spans need no in-flight count)."""
        with self._lock:
            if not span.lost:
                span.lost = True
                self._lost.append(span)

    def end_request(self, span: Span, *, lost: bool) -> None:
        """A request naming `span` got its reply, or (`lost`) its connection broke first."""
        with self._lock:
            span.inflight -= 1
            if lost:
                self.lose(span)
            self._maybe_free(span)

    def daemon_restarted(self) -> int:
        """A reconnect found another daemon instance: free the lost spans; the bytes freed."""
        with self._lock:
            lost, self._lost = self._lost, []
            freed = 0
            for span in lost:
                span.lost = False
                if span.holders <= 0 and span.inflight <= 0:
                    freed += span.size
                self._maybe_free(span)
            return freed

    def interrupt(self, error: BaseException) -> None:
        """Wake every waiter with `error` instead of space: the connection broke with requests in
        flight, whose spans the waiters might otherwise wait for until they time out."""
        with self._lock:
            waiters, self._waiters = self._waiters, deque()
            for waiter in waiters:
                waiter.error = error
                waiter.wake()

    def defer(self, lease: Lease, event: Event) -> None:
        with self._lock:
            self._deferred.append((lease, event))

    def _poll_deferred(self) -> None:
        if not self._deferred:
            return
        done = [(lease, event) for lease, event in self._deferred if event.query()]
        if done:
            self._deferred = [pair for pair in self._deferred if pair not in done]
            for lease, _ in done:
                lease.release()

    def _maybe_free(self, span: Span) -> None:
        if span.holders > 0 or span.inflight > 0 or span.lost:
            return
        if self._spans.get(span.offset) is not span:
            return  # freed already
        del self._spans[span.offset]
        if not self._spans:  # the last one: all of the region is free again
            self._free = [[0, self.size]]
        else:
            self._insert(span.offset, span.size)
        if self._waiters:
            self._serve()

    def _insert(self, offset: int, size: int) -> None:
        """Put [offset, offset + size) back in the free list, merged with its neighbours."""
        free = self._free
        lo = bisect.bisect_left(free, offset, key=lambda extent: extent[0])
        free.insert(lo, [offset, size])
        if lo + 1 < len(free) and offset + size == free[lo + 1][0]:
            free[lo][1] += free[lo + 1][1]
            del free[lo + 1]
        if lo > 0 and free[lo - 1][0] + free[lo - 1][1] == offset:
            free[lo - 1][1] += free[lo][1]
            del free[lo]

    def _serve(self) -> None:
        """Hand free space to waiters in order, stopping at the first that cannot be served."""
        while self._waiters:
            waiter = self._waiters[0]
            lease = self._take(waiter.nbytes, waiter.largest)
            if lease is None:
                return
            self._waiters.popleft()
            waiter.lease = lease
            waiter.wake()

    # --- what is where --------------------------------------------------------------------------

    def covering(self, offset: int, length: int) -> Span | None:
        """The live span that holds [offset, offset + length), if a lease holds one."""
        with self._lock:
            for span in self._spans.values():
                if span.offset <= offset and offset + length <= span.offset + span.size:
                    return span if span.holders > 0 else None
        return None

    def usage(self) -> RegionUsage:
        with self._lock:
            free = sum(size for _, size in self._free)
            lost = sum(span.size for span in self._lost)
            return RegionUsage(
                self.size,
                free,
                self.size - free,
                len(self._spans),
                lost,
                len(self._waiters),
            )


def _aligned(nbytes: int) -> int:
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
