"""The region allocator: leases never overlap a live use of the same bytes."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixd.client.leases import ALIGN, Lease, RegionAllocator
from prefixd.errors import RegionError, RegionFullError
from prefixd.wire.region import SharedRegion

from .harness import settle


@pytest.fixture
def allocator() -> RegionAllocator:
    return RegionAllocator(SharedRegion(1 << 16))


def test_leases_are_disjoint_aligned_and_come_back(allocator: RegionAllocator) -> None:
    a = allocator.try_acquire(100)
    b = allocator.try_acquire(1000)
    assert a is not None and b is not None
    assert a.offset % ALIGN == 0 and b.offset % ALIGN == 0
    assert a.offset + 100 <= b.offset or b.offset + 1000 <= a.offset
    assert allocator.usage().leases == 2
    a.release()
    b.release()
    usage = allocator.usage()
    assert (usage.leases, usage.free_bytes) == (0, 1 << 16)


def test_a_released_view_raises_instead_of_reading_reused_bytes(allocator: RegionAllocator) -> None:
    lease = allocator.try_acquire(64)
    assert lease is not None
    view = lease.view
    view[:4] = b"mine"
    lease.release()
    with pytest.raises(ValueError):
        bytes(view)
    with pytest.raises(RegionError):
        lease.view  # noqa: B018
    again = allocator.try_acquire(64)
    assert again is not None and again.offset == lease.offset  # the span was reused ...
    again.view[:4] = b"next"  # ... and the old view cannot see it


def test_an_exported_view_keeps_its_span_until_it_is_gone(allocator: RegionAllocator) -> None:
    lease = allocator.try_acquire(1 << 15)
    assert lease is not None
    array = np.frombuffer(lease.view, dtype=np.uint8)[10:]  # numpy keeps the buffer alive
    array[:] = 7
    lease.release()
    # the whole region is not free while the array lives: a full-size lease cannot be had
    assert allocator.try_acquire(1 << 16) is None
    assert int(array.sum()) == 7 * array.size  # still our bytes
    del array
    assert allocator.try_acquire(1 << 16) is not None


def test_a_lease_dropped_without_release_is_given_back(allocator: RegionAllocator) -> None:
    lease = allocator.try_acquire(1 << 16)
    assert lease is not None
    del lease
    assert allocator.usage().free_bytes == 1 << 16


def test_views_of_a_dropped_lease_stay_valid_and_hold_the_span(
    allocator: RegionAllocator,
) -> None:
    """`client.load(...).views`: the result is gone at once, its views are not."""
    lease = allocator.try_acquire(1 << 16)
    assert lease is not None
    lease.view[:3] = b"abc"
    views = (lease.slice(0, 3),)
    del lease
    assert allocator.try_acquire(64) is None  # the views hold the span
    assert bytes(views[0]) == b"abc"
    del views
    assert allocator.try_acquire(1 << 16) is not None


def test_a_request_in_flight_holds_its_span_past_release(allocator: RegionAllocator) -> None:
    lease = allocator.try_acquire(1 << 16)
    assert lease is not None
    span = lease.span
    span.begin_request()
    lease.release()  # the caller gave up (a cancelled task): the daemon may still write
    assert allocator.try_acquire(64) is None
    span.end_request(lost=False)  # the reply arrived
    assert allocator.try_acquire(64) is not None


def test_a_lost_request_quarantines_its_span_until_the_daemon_restarts(
    allocator: RegionAllocator,
) -> None:
    lease = allocator.try_acquire(1 << 16)
    assert lease is not None
    lease.span.begin_request()
    lease.span.end_request(lost=True)
    lease.release()
    assert allocator.usage().quarantined_bytes == 1 << 16
    assert allocator.try_acquire(64) is None
    assert allocator.daemon_restarted() == 1 << 16
    assert allocator.usage().free_bytes == 1 << 16


def test_too_large_fails_at_once_naming_the_region_size(allocator: RegionAllocator) -> None:
    with pytest.raises(RegionFullError, match="holds 65536"):
        allocator.acquire(1 << 17, timeout=60)


def test_a_full_region_waits_then_fails_clearly(allocator: RegionAllocator) -> None:
    held = allocator.try_acquire(1 << 16)
    assert held is not None
    with pytest.raises(RegionFullError, match="of 65536 bytes has no free span of 64 bytes"):
        allocator.acquire(64, timeout=0.01)
    assert allocator.usage().waiters == 0


def test_a_waiting_thread_is_served_when_space_is_freed(allocator: RegionAllocator) -> None:
    held = allocator.try_acquire(1 << 16)
    assert held is not None
    got: list[Lease] = []
    started = threading.Event()

    def wait() -> None:
        started.set()
        got.append(allocator.acquire(1 << 15, timeout=60))

    thread = threading.Thread(target=wait)
    thread.start()
    started.wait()
    while allocator.usage().waiters == 0:
        threading.Event().wait(0.001)
    held.release()
    thread.join(60)
    assert got and got[0].size == 1 << 15


def test_waiters_are_served_in_order(allocator: RegionAllocator) -> None:
    """A large request is not starved by small ones that arrive after it."""
    held = allocator.try_acquire(1 << 16)
    assert held is not None

    async def scenario() -> list[int]:
        order: list[int] = []

        async def want(nbytes: int, tag: int) -> None:
            lease = await allocator.acquire_async(nbytes, timeout=60)
            order.append(tag)
            lease.release()

        big = asyncio.create_task(want(1 << 16, 0))
        await settle(lambda: allocator.usage().waiters == 1)
        small = asyncio.create_task(want(64, 1))
        await settle(lambda: allocator.usage().waiters == 2)
        assert allocator.try_acquire(64) is None  # queued behind the waiters
        held.release()
        await asyncio.gather(big, small)
        return order

    assert asyncio.run(scenario()) == [0, 1]


def test_a_cancelled_async_waiter_leaves_nothing_behind(allocator: RegionAllocator) -> None:
    held = allocator.try_acquire(1 << 16)
    assert held is not None

    async def scenario() -> None:
        task = asyncio.create_task(allocator.acquire_async(64, timeout=60))
        await settle(lambda: allocator.usage().waiters == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    held.release()
    usage = allocator.usage()
    assert (usage.waiters, usage.leases, usage.free_bytes) == (0, 0, 1 << 16)


def test_largest_takes_the_largest_free_span_and_trim_gives_the_rest_back(
    allocator: RegionAllocator,
) -> None:
    first = allocator.try_acquire(1000)
    assert first is not None
    rest = allocator.try_acquire(1, largest=True)
    assert rest is not None and rest.size == (1 << 16) - 1024
    rest.trim(100)
    assert allocator.usage().free_bytes == (1 << 16) - 1024 - 128


class LeaseMachine(RuleBasedStateMachine):
    """Random leases, views, releases, requests in flight and losses against a model: no two
    live uses overlap, every released view raises, and all space comes back in the end."""

    def __init__(self) -> None:
        super().__init__()
        self.allocator = RegionAllocator(SharedRegion(1 << 14))
        self.leases: list[tuple[Lease, bytes]] = []
        self.released_views: list[memoryview] = []
        self.exports: list[tuple[np.ndarray, bytes]] = []
        self.inflight: list[Lease] = []
        self.lost: list[tuple[int, int]] = []  # spans a lost request may still write
        self.counter = 0

    def _fill(self, lease: Lease) -> bytes:
        self.counter += 1
        pattern = (self.counter.to_bytes(4, "little") * (lease.size // 4 + 1))[: lease.size]
        lease.view[:] = pattern
        return pattern

    @rule(nbytes=st.integers(1, 6000), largest=st.booleans())
    def acquire(self, nbytes: int, largest: bool) -> None:
        lease = self.allocator.try_acquire(nbytes, largest=largest)
        if lease is not None:
            assert lease.size >= nbytes
            self.leases.append((lease, self._fill(lease)))

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease, _ = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        view = lease.view
        if data.draw(st.booleans()):  # keep a numpy export alive past the release
            self.exports.append((np.frombuffer(view, dtype=np.uint8), bytes(view)))
        else:
            self.released_views.append(view)
        lease.release()

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), lost=st.booleans())
    def request(self, data: st.DataObject, lost: bool) -> None:
        """A request names a lease; its caller gives up at once; the reply comes or is lost."""
        lease, _ = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        lease.span.begin_request()
        lease.release()
        if lost:
            lease.span.end_request(lost=True)
            self.lost.append((lease.offset, lease.size))
        else:
            self.inflight.append(lease)

    def _daemon_writes(self, offset: int, size: int) -> None:
        """What a daemon still working on a request may do: write its span."""
        self.allocator.region.view[offset : offset + size] = b"\xee" * size

    @precondition(lambda self: self.inflight)
    @rule()
    def reply(self) -> None:
        lease = self.inflight.pop(0)
        self._daemon_writes(lease.offset, lease.size)  # up to its reply
        lease.span.end_request(lost=False)

    @precondition(lambda self: self.exports)
    @rule()
    def drop_export(self) -> None:
        self.exports.pop(0)

    @rule()
    def daemon_restarted(self) -> None:
        for offset, size in self.lost:  # the old daemon's last writes, before it died
            self._daemon_writes(offset, size)
        self.lost.clear()
        self.allocator.daemon_restarted()

    @invariant()
    def live_bytes_are_intact(self) -> None:
        for lease, pattern in self.leases:
            assert bytes(lease.view[: len(pattern)]) == pattern
        for array, pattern in self.exports:
            assert array.tobytes() == pattern

    @invariant()
    def released_views_raise(self) -> None:
        for view in self.released_views[-3:]:
            with pytest.raises(ValueError):
                view.tobytes()

    def teardown(self) -> None:
        self.leases.clear()
        self.exports.clear()
        for lease in self.inflight:
            lease.span.end_request(lost=False)
        self.allocator.daemon_restarted()
        usage = self.allocator.usage()
        assert (usage.leases, usage.free_bytes) == (0, self.allocator.size)


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
